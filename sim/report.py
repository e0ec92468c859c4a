"""One policy's run as numbers: latency percentiles, throughput, goodput, energy, cache, regimes.

Definitions (all from `sim.simulator.SimResult`; times in virtual seconds):

- TTFT = first token − arrival; E2E = finish − arrival; ITL = a request's mean time per
  output token after the first, (finish − first token) / (max_tokens − 1), over requests of
  two tokens or more (the client's mean gap between content chunks, `gateway.commands.replay`);
  percentiles with linear interpolation (`percentile`), over finished requests.
- throughput_rps = finished requests / makespan, makespan = last finish − first arrival.
- goodput_rps = finished requests with TTFT ≤ ``ttft_slo_s`` / makespan.
- energy_per_request_j = the whole fleet's joules over the makespan (idle included) /
  finished requests.
- prefix_hit_ratio = Σ cached prompt tokens / Σ prompt tokens, as the engines reported
  them (``usage.prompt_tokens_details.cached_tokens``); host_hit_ratio = the part of it
  loaded from host tiers.
- disaggregated_share = share of routed requests split (P/D: prefilled on one backend, decoded on
  another; `sim.pd`); transfer_s_p50 / p90 = the seconds their KV pulls took (None without splits).
- regime_share = share of requests whose chosen backend's predicted regime was compute /
  transfer (the x-kappa-regime the gateway would have sent).
- Per backend, as the demo reports (`gateway.commands.demo_figures.build_report`): requests (decoded
  there; a split's prefill backend counts it in ``prefill_requests``);
  ``kappa_crit_linear`` (the backend's T-independent κ_crit); transfer = requests routed
  there transfer-bound (their κ_ratio_loaded above their own κ_crit there, the
  x-kappa-regime); high-κ = κ_ratio above one fleet-wide threshold, the lowest
  κ_crit_linear of the compute-dense backends (`sim.fleet.high_kappa_threshold`);
  large-T = new prompt tokens (prompt − cached, engine-reported) at or above their p90 over
  the run. ``*_share`` is that part of the backend's own requests (as the demo reports);
  ``*_of_all`` is the backend's part of all such requests of the run (summing to 1 over backends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.fleet import SimBackend, high_kappa_threshold
from sim.simulator import RequestRecord, SimResult

DEFAULT_TTFT_SLO_S = 5.0
"""TTFT SLO for goodput, s. A p95-length Mooncake prompt (≈40k tokens) of Llama-3.1-70B
prefills in ≈3.8 s alone on a B200 ×2 (40k × (141 GFLOP + attention) / 2.02 PFLOP/s): the SLO
leaves about a second for queueing there, less on slower backends."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _hardware(b: SimBackend) -> str:
    spec = b.spec
    cap = f" capped {spec.power_cap_w:g} W" if spec.power_cap_w else ""
    return f"{spec.hardware.name} x{spec.tensor_parallel}{cap}"


def policy_report(result: SimResult, *, ttft_slo_s: float = DEFAULT_TTFT_SLO_S) -> dict[str, Any]:
    """Summarise one run (definitions in the module docstring).

    Returns:
        ``{"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "itl_p50_s",
        "itl_p90_s", "throughput_rps",
        "goodput_rps", "ttft_slo_s", "energy_per_request_j", "disaggregated_share", "transfer_s_p50",
        "transfer_s_p90", "energy_j", "prefix_hit_ratio",
        "host_hit_ratio", "kv_pool_hit_ratio", "regime_share": {"compute", "transfer"}, "requests", "finished",
        "rejected", "makespan_s", "high_kappa_threshold", "large_t_threshold_tokens",
        "backends": [{"id", "hardware", "role", "kappa_crit_linear", "requests", "prefill_requests", "request_share",
        "transfer_requests", "transfer_share",
        "high_kappa_requests", "high_kappa_share", "high_kappa_of_all", "large_t_requests",
        "large_t_share", "large_t_of_all",
        "prefix_hit_ratio", "ttft_p50_s", "energy_j"}], "wall_s"}``; figures with no data are None.
    """
    done = [r for r in result.records if r.finish_s is not None and r.first_token_s is not None]
    makespan = result.end_s - result.start_s
    ttfts = [r.first_token_s - r.arrival_s for r in done]
    e2es = [r.finish_s - r.arrival_s for r in done]
    itls = [(r.finish_s - r.first_token_s) / (r.max_tokens - 1) for r in done if r.max_tokens > 1]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    host = sum(r.cached_host_tokens for r in done)
    kv_pool = sum(r.cached_kv_pool_tokens for r in done)
    routed = len(result.records)
    transfer = sum(r.regime == "transfer" for r in result.records)
    energy = sum(result.energy_j.values())
    high_kappa = high_kappa_threshold(result.backends)
    large_t = percentile([r.prompt_tokens - r.cached_tokens for r in done], 90)
    n_high = sum(r.kappa_ratio > high_kappa for r in result.records)
    n_large = sum(large_t is not None and r.prompt_tokens - r.cached_tokens >= large_t for r in done)
    backends = _backend_rows(result, done, high_kappa, large_t, n_high, n_large)
    transfers = [r.transfer_s for r in result.records if r.prefill_backend_id is not None]
    return {
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50), "e2e_p90_s": percentile(e2es, 90), "e2e_p99_s": percentile(e2es, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p90_s": percentile(itls, 90),
        "throughput_rps": len(done) / makespan if makespan > 0 else None,
        "goodput_rps": sum(t <= ttft_slo_s for t in ttfts) / makespan if makespan > 0 else None,
        "ttft_slo_s": ttft_slo_s,
        "energy_per_request_j": energy / len(done) if done else None, "energy_j": energy,
        "disaggregated_share": _share(len(transfers), routed),
        "transfer_s_p50": percentile(transfers, 50), "transfer_s_p90": percentile(transfers, 90),
        "prefix_hit_ratio": _share(cached, prompt), "host_hit_ratio": _share(host, prompt),
        "kv_pool_hit_ratio": _share(kv_pool, prompt),
        "regime_share": {"compute": _share(routed - transfer, routed), "transfer": _share(transfer, routed)},
        "requests": routed + len(result.rejected), "finished": len(done), "rejected": len(result.rejected),
        "makespan_s": makespan, "high_kappa_threshold": high_kappa, "large_t_threshold_tokens": large_t,
        "backends": backends, "wall_s": result.wall_s,
    }


def _backend_rows(result: SimResult, done: list[RequestRecord], high_kappa: float, large_t: float | None,
                  n_high: int, n_large: int) -> list[dict[str, Any]]:
    """`policy_report`'s ``backends``: per backend its share of the requests, of the high-κ
    (κ_ratio > ``high_kappa``) and of the large-T (≥ ``large_t`` uncached tokens) ones."""
    rows = []
    for b in result.backends:
        mine = [r for r in result.records if r.backend_id == b.id]
        mine_done = [r for r in done if r.backend_id == b.id]
        b_prompt = sum(r.prompt_tokens for r in mine_done)
        high = sum(r.kappa_ratio > high_kappa for r in mine)
        large = sum(large_t is not None and r.prompt_tokens - r.cached_tokens >= large_t for r in mine_done)
        rows.append({
            "id": b.id, "hardware": _hardware(b), "role": b.labels.get("role", ""),
            "kappa_crit_linear": b.spec.kappa_crit_linear, "requests": len(mine),
            "prefill_requests": sum(r.prefill_backend_id == b.id for r in result.records),
            "request_share": _share(len(mine), len(result.records)),
            "transfer_requests": sum(r.regime == "transfer" for r in mine),
            "transfer_share": _share(sum(r.regime == "transfer" for r in mine), len(mine)),
            # *_share: of this backend's requests (as in the demo's report); *_of_all: of the run's
            "high_kappa_requests": high, "high_kappa_share": _share(high, len(mine)),
            "high_kappa_of_all": _share(high, n_high),
            "large_t_requests": large, "large_t_share": _share(large, len(mine_done)),
            "large_t_of_all": _share(large, n_large),
            "prefix_hit_ratio": _share(sum(r.cached_tokens for r in mine_done), b_prompt),
            "ttft_p50_s": percentile([r.first_token_s - r.arrival_s for r in mine_done], 50),
            "energy_j": result.energy_j.get(b.id),
        })
    return rows
