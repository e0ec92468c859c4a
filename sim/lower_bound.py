"""A lower bound on each request's TTFT, and every policy's distance from it.

The bound of a request is its prefill time on its best backend with nothing queued and the
best cache it could possibly find there:

    K_i  = the tokens of its prompt that some earlier request's prompt began with
           (`sim.workloads.shareable_prefix_tokens`: an infinite cache shared by the whole
           fleet), capped at P_i − 1 as vLLM caps a hit (REFERENCE.md §3);
    LB_i = min over backends b of router.cost.predict(K_i in HBM, 0 in host tier,
           T_i = P_i − K_i new tokens, 1 output token, queue wait 0).ttft_s

**The assumption:** on the backend evaluated, the whole shareable prefix is resident in
HBM (read in place, never loaded over the host link), no other request runs, and the
backend is the fastest for this request. No policy can do better on this fleet, whatever
it knows: TTFT_i ≥ LB_i up to the engine's step granularity (the engine's prefill is the
same roofline, `mock_vllm.engine`, so the ratio is ≥ 1 but for one rounding: the engine
caches in 16-token blocks and this bound counts whole shared 512-token trace blocks, which
only lowers LB). A request whose prefix was never seen before has K = 0: its full prefill.

The ratios reported per policy (``ttft_p50_lower_bound_ratio`` = policy TTFT p50 / LB p50,
the same at p90, and ``ttft_mean_lower_bound_ratio`` = the mean over finished requests of
TTFT_i / LB_i) say how much of a policy's latency is queueing, lost cache and slow links
rather than the work itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any

from router.cost import RequestShape, predict
from sim.fleet import SimBackend
from sim.report import percentile
from sim.simulator import SimResult
from sim.traces import TraceRequest
from sim.workloads.sessions import shareable_prefix_tokens


def lower_bound_ttfts(requests: Sequence[TraceRequest], backends: Sequence[SimBackend]) -> list[float]:
    """Per request (input order), its TTFT lower bound LB_i in seconds (module docstring).

    Args:
        requests: the trace, any order (the shared prefix is found in arrival order).
        backends: the candidates (a fleet's backends serving the requests' model), ≥ 1.

    Raises:
        ValueError: no backends.
    """
    if not backends:
        raise ValueError("the lower bound needs at least one backend")
    specs = [b.engine_spec for b in backends]  # the engines' own (a truth fleet's, `sim.fleet.fleet_with_truth`)
    out = []
    for req, shared in zip(requests, shareable_prefix_tokens(requests), strict=True):
        cached = min(shared, max(req.input_tokens - 1, 0))
        shape = RequestShape(cached_hbm_tokens=cached, cached_host_tokens=0,
                             uncached_prompt_tokens=req.input_tokens - cached, output_tokens=1)
        out.append(min(predict(shape, spec).ttft_s for spec in specs))
    return out


def lower_bound_summary(bounds: Sequence[float]) -> dict[str, Any]:
    """``{"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s"}`` of the bounds (None when empty)."""
    return {"ttft_p50_s": percentile(bounds, 50), "ttft_p90_s": percentile(bounds, 90),
            "ttft_p99_s": percentile(bounds, 99), "ttft_mean_s": fmean(bounds) if bounds else None}


def lower_bound_ratios(result: SimResult, bounds: Sequence[float]) -> dict[str, float | None]:
    """One policy's TTFT against the bound (module docstring).

    Args:
        result: the run; its records' ``index`` is the request's position in ``bounds``.
        bounds: `lower_bound_ttfts` of the same trace, in trace order.

    Returns:
        ``{"ttft_p50_lower_bound_ratio", "ttft_p90_lower_bound_ratio",
        "ttft_mean_lower_bound_ratio"}``, dimensionless, over finished requests; None
        without finished requests.
    """
    done = [r for r in result.records if r.first_token_s is not None]
    ttfts = [r.first_token_s - r.arrival_s for r in done]
    mine = [bounds[r.index] for r in done]
    lb50, lb90 = percentile(mine, 50), percentile(mine, 90)
    p50, p90 = percentile(ttfts, 50), percentile(ttfts, 90)
    return {
        "ttft_p50_lower_bound_ratio": p50 / lb50 if p50 is not None and lb50 else None,
        "ttft_p90_lower_bound_ratio": p90 / lb90 if p90 is not None and lb90 else None,
        "ttft_mean_lower_bound_ratio": fmean(t / b for t, b in zip(ttfts, mine, strict=True)) if done else None,
    }
