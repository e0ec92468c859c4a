"""Issue 14: the hot-path work changes how fast the router decides, never what it decides.

`bench/routing_quality.py --quick`'s runs — every policy, both fleets, the middle load of
each workload it sweeps (the synthetic ones here; the Mooncake trace too when
``../shared/data`` exists) — are simulated, and every decision — the ranking, every candidate's K by tier, T, admission
and every figure of its cost estimate, the reason — and every request's simulated first-token
and finish times and each backend's energy are digested, bit for bit (``float.hex``).
The digests in ``decisions_golden.json`` were made on 5f7ed15, before any of issue 14's
changes; a change that moves one decision, or one predicted figure by one ulp, fails here.

Regenerated for issue 25 (the κ policy's E2E objective: its decode priced in the batch it joins,
`router.decode`): the ``kappa`` digests moved, every anchor's stayed; ``kappa-ttft`` (κ with
``decode_weight`` and ``interference_weight`` 0, the TTFT objective, and the energy band of
0.05 it had) keeps the digests the
``kappa`` runs had before it, bit for bit, so that objective is still exactly the old κ.

Issue 29: the runs measure each backend's figures as the gateway does and route on them (the
configs' ``routing.measured_figures``, on by default); the profiles being the mocks' own here, no
measured factor leaves 1 and every digest stays. With measurement off (one workload, to hold the
setting's other side) they stay too.

Regenerate (only for a change that means to alter routing, saying so in its commit):
``KAPPA_REGENERATE_GOLDEN=1 python -m pytest tests/unit/router/test_decisions_unchanged.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).with_name("decisions_golden.json")
WORKLOADS = ("chat", "agentic-coding", "document-qa")
TTFT_OBJECTIVE = {"decode_weight": 0.0, "interference_weight": 0.0, "energy_tie_ratio": 0.05}  # κ before issue 25


def _hex(value: object) -> str:
    return float(value).hex() if isinstance(value, (int, float)) else str(value)


def _digest(workload: str, *, measuring: bool = True) -> dict[str, str]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from routing_quality import PLAN, POLICIES, load_fleets
    finally:
        sys.path.remove(str(REPO / "bench"))
    from router.policies import build_policy
    from sim.simulator import DecisionEvent, simulate
    from sim.prompts import prepare_trace
    from sim.workloads import build_workload

    plan = PLAN[workload]
    requests = build_workload(workload, plan.quick_requests, 0)
    scale = plan.rate_scales[len(plan.rate_scales) // 2]
    out = {}
    for name, fleet in load_fleets().items():
        if not measuring:
            fleet = dataclasses.replace(fleet, measurement=dataclasses.replace(fleet.measurement, enabled=False))
        trace = prepare_trace(requests, model=fleet.served_models()[0], block_size_bytes=fleet.block_size_bytes)
        trace = [dataclasses.replace(p, arrival_s=p.arrival_s / scale) for p in trace]
        for label, policy, params in [(p, p, {}) for p in POLICIES] + [("kappa-ttft", "kappa", TTFT_OBJECTIVE)]:
            h = hashlib.sha256()

            def observe(event: DecisionEvent) -> None:
                h.update(f"{event.request_index}|{event.decision.reason}|".encode())
                for c in event.decision.ranked:  # every candidate, best first, with every figure
                    figures = list(c.estimate)
                    h.update(f"{c.backend_id}:{c.cached_hbm_tokens}:{c.cached_host_tokens}:{c.cached_kv_pool_tokens}:"
                             f"{c.uncached_prompt_tokens}:{c.admitted}:{':'.join(map(_hex, figures))};".encode())

            result = simulate(fleet, build_policy(policy, params), trace, seed=0, observer=observe)
            for r in result.records:
                h.update(f"{r.index}:{r.backend_id}:{_hex(r.first_token_s or -1.0)}:{_hex(r.finish_s or -1.0)};".encode())
            h.update(repr(sorted(result.rejected)).encode())
            h.update(repr(sorted((k, _hex(v)) for k, v in result.energy_j.items())).encode())
            out[f"{name}/{label}"] = h.hexdigest()
    return out


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_routing_quality_runs_decide_exactly_as_before(workload: str) -> None:
    digests = _digest(workload)
    if os.environ.get("KAPPA_REGENERATE_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[workload] = digests
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())[workload]
    changed = sorted(k for k in golden if digests.get(k) != golden[k])
    assert not changed, f"{workload}: decisions or predicted figures changed for {changed}"


def test_measurement_off_decides_exactly_as_before() -> None:
    golden = json.loads(GOLDEN.read_text())["document-qa"]
    digests = _digest("document-qa", measuring=False)
    assert sorted(k for k in golden if digests.get(k) != golden[k]) == []
