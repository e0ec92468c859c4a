"""A split (P/D) decision's bookkeeping: a ticket on each of its two backends.

Shared by the gateway (live) and the simulator (virtual time), as `dispatch.pipeline` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dispatch.ledger import Ticket
from dispatch.target import Target
from prefix_index import PendingChains
from router import kappa
from router.decode import decode_context_tokens
from router.types import Decision, RequestFeatures


def charge_split(pending: PendingChains, model: str, hashes: Sequence[int], features: RequestFeatures,
                 decision: Decision, targets: Mapping[str, Target], *, pending_engine: PendingChains | None = None,
                 engine_hashes: Sequence[int] = ()) -> tuple[Ticket, Ticket]:
    """Charge a split decision (``decision.prefill`` set) of a request (``model``, its chain
    ``hashes``, its ``features``) to both its backends (of ``targets``), now. Its engine chain
    (``engine_hashes``, when the exact index routed it: `dispatch.exact`) is marked in flight in
    ``pending_engine`` as its byte chain is in ``pending``.

    Returns:
        (the prefill ticket, the decode ticket). The prefill backend holds the prompt's KV,
        kv_bytes(P), and its predicted prefill seconds until the decode backend has pulled the KV
        (finish the ticket then: vLLM's NixlConnector frees a prefill's blocks once they are read);
        it decodes nothing. The decode backend holds the request's whole KV demand and its decode
        context, with no prefill seconds (it samples once the KV has arrived). Only the prefill
        backend's chain is marked in flight (``pending``): it computes the blocks now. The decode
        backend caches them only once they have arrived (vLLM registers pulled blocks when the
        transfer completes), so it is credited with them when its first token comes (the caller
        records it then). Crediting it at the decision priced the next request of a conversation
        as a full hit there, to recompute 90k tokens while the pull was still under way (the
        simulator, document-qa on the P/D fleet: κ's TTFT p90 2.92 s against 0.033 s without the
        early credit; BENCHMARKS.md "P/D disaggregation (simulator)").

    Raises:
        ValueError: the plan is not split.
    """
    leg = decision.prefill
    if leg is None:
        raise ValueError("charge_split needs a split decision (Decision.prefill)")
    prefill_target = targets[leg.candidate.backend_id]
    pending.add(model, prefill_target.id, hashes)
    if pending_engine is not None:
        pending_engine.add(model, prefill_target.id, engine_hashes)

    def ended() -> None:
        pending.remove(model, prefill_target.id, hashes)
        if pending_engine is not None:
            pending_engine.remove(model, prefill_target.id, engine_hashes)

    prompt_kv = kappa.model_constants(prefill_target.spec.model).kv_bytes(max(features.prompt_tokens, 1))
    prefill = Ticket(prefill_target.ledger, prompt_kv, leg.candidate.estimate.prefill_s, on_finish=ended)
    chosen = decision.chosen
    decode = Ticket(targets[chosen.backend_id].ledger, chosen.estimate.kv_demand_bytes, 0.0,
                    context_tokens=decode_context_tokens(features),
                    output_tokens=float(features.sequences * max(features.max_tokens, 1)))
    return prefill, decode
