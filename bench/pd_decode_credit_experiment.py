"""Experiment, not the gateway's behaviour: ``routing_quality.py --pd`` with a split's decode backend
credited with the prompt's chain only once its pull is done.

`dispatch.split.charge_split` (as merged) marks the chain in flight on both backends at decision
time, so the index overlay credits the decode backend with the prefix while its KV is still being
prefilled elsewhere and pulled. vLLM's decode instance caches the pulled blocks only when they have
arrived; a follower sent there before recomputes the whole prompt (on a decode node), and its long
chunked prefill then holds the token budget the split's decode waits for. This script replaces
``charge_split`` (in this process only) by one that marks the chain on the prefill backend alone;
the decode backend's chain reaches the index when its first token comes back, as for any request.
Everything else is the committed code. Usage: the arguments of ``bench/routing_quality.py``;
results go to ``bench/results/routing_quality_pd_decode_credit.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import hot_path  # noqa: E402

hot_path.select()

import dispatch.pipeline  # noqa: E402
import routing_quality  # noqa: E402
from dispatch.ledger import Ticket  # noqa: E402
from router import kappa  # noqa: E402
from router.decode import decode_context_tokens  # noqa: E402


def charge_split_after_pull(pending, plan):  # type: ignore[no-untyped-def]
    """`dispatch.split.charge_split` but for the decode backend's chain, left out of the overlay."""
    leg = plan.decision.prefill
    model, hashes, features = plan.request.model, plan.request.hashes, plan.features
    p = plan.targets[leg.candidate.backend_id]
    pending.add(model, p.id, hashes)
    prompt_kv = kappa.model_constants(p.spec.model).kv_bytes(max(features.prompt_tokens, 1))
    prefill = Ticket(p.ledger, prompt_kv, leg.candidate.estimate.prefill_s,
                     on_finish=lambda: pending.remove(model, p.id, hashes))
    chosen = plan.decision.chosen
    decode = Ticket(plan.targets[chosen.backend_id].ledger, chosen.estimate.kv_demand_bytes, 0.0,
                    context_tokens=decode_context_tokens(features),
                    output_tokens=float(features.sequences * max(features.max_tokens, 1)))
    return prefill, decode


if __name__ == "__main__":
    dispatch.pipeline.charge_split = charge_split_after_pull  # type: ignore[assignment]
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv += ["--out", str(routing_quality.RESULTS / "routing_quality_pd_decode_credit.json")]
    raise SystemExit(routing_quality.main(argv))
