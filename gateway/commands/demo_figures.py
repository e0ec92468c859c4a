"""The demo's figures from one run's replay results and scraped metrics: per backend and per run.

Every share and column the report prints is defined once, in `DEFINITIONS`: the JSON carries
it (``definitions``), the printed legend prints it (`gateway.commands.demo_report`), and the
docstrings below name its keys instead of restating them. In short, the two shares that read
alike are different things: **transfer share** is the gateway's regime (each request against
its own κ_crit on the backend that served it, ``x-kappa-regime``), the report's one transfer
share; **high-κ share** is a property of the request (κ_ratio over every cached token, HBM
included, against one fleet-wide threshold), the same wherever it is sent, which asks where
long-cached follow-ups went. ``high_kappa_transfer_requests`` reconciles the two per backend.

TTFT, E2E and ITL are measured by the client on the wall clock (`gateway.commands.replay`) and
divided by the mocks' time scale, so they read in modelled seconds (at time scale 1 they agree).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from fleet_config.catalog import default_catalog
from fleet_config.settings import BackendEntry, Settings
from gateway.commands.demo_pd import backend_pd_hit, pd_figures, pd_run_hits
from gateway.commands.replay import RequestResult
from router.profiles import Catalog
from sim.report import percentile

ENERGY_METRIC = "mock_vllm:energy_joules_total"
SELF_CONSISTENCY = (
    "On the demo's mock backends this is a self-consistency check: the mocks time their prefills by the same "
    "roofline the router predicts with, so agreement shows that the fit and the κ_crit feed work, not that the "
    "profiles match real hardware.")
"""What the measured κ_crit shows on mocks, said where it is printed and in its definition."""

DEFINITIONS: dict[str, str] = {
    "transfer_share": (
        "transfer share = requests the gateway labelled transfer-bound (x-kappa-regime: transfer), each against its "
        "own κ_crit on the backend that served it: κ_ratio_loaded = K_loaded/T (host-tier and KV-pool tokens over "
        "new ones) above its x-kappa-crit. Per backend: of that backend's requests; per run: of all successful "
        "requests. A baseline policy's requests carry the same header, for the backend it chose."),
    "high_kappa_share": (
        "high-κ share = requests whose κ_ratio = K/T over every cached token (HBM included) exceeds one fleet-wide "
        "threshold, the lowest κ_crit_linear of the compute-dense backends: a property of the request's prefix, "
        "the same wherever it is sent, not its regime. A high-κ request whose K is read in place from HBM loads "
        "nothing, and a request's own κ_crit (at its T and K_hbm, over its link) differs from κ_crit_linear, so a "
        "backend's high-κ share can far exceed its transfer share (a GH200's κ_crit_linear is ~290)."),
    "large_t_share": (
        "large-T share = requests whose new prompt tokens T = prompt − cached (engine-reported) are at or above "
        "the run's p90, large_t_threshold_tokens."),
    "kappa_crit_linear": (
        "κ_crit_lin = the backend's T-independent κ_crit_linear = κ_M·κ_HW at its host link (linear F_pf, the "
        "paper's figure), from the profiles."),
    "kappa_ratio": "κ = κ_ratio = K/T over every cached prompt token (x-kappa-ratio, the index's estimate).",
    "kappa_ratio_loaded": "κ_load = κ_ratio_loaded = K_loaded/T over the host-tier and KV-pool tokens, which must "
                          "be loaded (x-kappa-ratio-loaded).",
    "kappa_crit_p50": (
        "κ_crit p50 = the lower median of the backend's requests' x-kappa-crit: each request's own κ_crit there, at "
        "its T and K_hbm, over the link its loads cross."),
    "never": (
        "never = x-kappa-crit is inf: no cached prefix, however long, makes the request transfer-bound there (at "
        "its T the attention compute grows at least as fast as any load: router.kappa, c·a·T ≥ 1). κ_crit p50 "
        "reads never when the median request is such a one (null in JSON; kappa_crit_never_requests counts them)."),
    "prefix_hit_ratio": (
        "hit = prefix hit ratio: prompt tokens some backend found in its own cache (HBM, host tier or the shared KV "
        "pool) instead of prefilling them, over the prompt tokens of the successful requests: Σ cached / Σ prompt "
        "tokens as the backends reported them (usage.prompt_tokens_details.cached_tokens), except on a "
        "disaggregated fleet (prefix_hit_ratio_pd)."),
    "prefix_hit_ratio_pd": (
        "hit on a P/D fleet = a split request's decode answer reports P − 1 cached (vLLM counts pulled KV as "
        "cached), so the hit is 1 − (Σ computed − split decodes) / Σ prompt tokens, computed = the backends' own "
        "vllm:prompt_tokens_by_source_total{source=\"local_compute\"} over the run, less the one token each split "
        "decode recomputes; per backend, over the prompts it prefilled (whole or a split's prefill). KV moved "
        "between backends is not a hit: it is kv_transferred_tokens."),
    "ttft": "TTFT = send → first content chunk, measured by the client, in modelled seconds (wall / time scale).",
    "e2e": "E2E = send → end of the stream, modelled seconds.",
    "itl": "ITL = a request's mean gap between content chunks, modelled seconds; p50 over the requests.",
    "energy_per_request_j": (
        "J/req = the mocks' mock_vllm:energy_joules_total over the whole run (idle draw included) / successful "
        "requests; per backend, its own energy / its own requests."),
    "idle": (
        "idle = a backend that served no request in the run: it has no per-request figures (TTFT, hit, J/req, "
        "shares), and shows idle, never 0, NaN or ∞ (null in JSON)."),
    "kappa_crit_measured": (
        "measured κ_crit = κ_crit_linear as the gateway measured it from the backends' own prefill times "
        "(router/kappa_fit.py), with its 95% interval. " + SELF_CONSISTENCY),
    "kv_role": (
        "kv_role = the backend's role in a P/D fleet (config kv_role): prefill (prefills requests another backend "
        "decodes), decode (decodes, pulling a split request's KV over the link), both (serves whole requests, and "
        "either phase). A split request counts as the decode backend's (x-kappa-backend); prefills = the split "
        "requests a backend prefilled (x-kappa-prefill-backend), so a prefill-only backend shows idle with prefills."),
    "split_share": (
        "split share = successful requests the gateway split (prefilled on one backend, decoded on another: their "
        "answer carries x-kappa-prefill-backend) / all successful requests; P/D fleets only (null otherwise). "
        "splits_counted_by_gateway = the gateway's gateway_pd_splits_total, the same count from its side."),
    "splits_per_pair": (
        "splits per pair = the split requests per (prefill backend, decode backend): x-kappa-prefill-backend and "
        "x-kappa-backend of each answer; the KV of each crossed link(prefill, decode) of the config's interconnect."),
    "kv_transferred_tokens": (
        "KV transferred = the KV the decode backends pulled from prefill backends over the run (their "
        "vllm:nixl_bytes_transferred), in tokens at the model's KV bytes per token; P/D fleets only (absent otherwise)."),
    "kappa_vs_baseline": (
        "κ/baseline = κ's figure over the baseline's, on the same seed, arrivals and prompts, each run on a fresh "
        "fleet (cold caches): below 1, κ's is lower (better for TTFT, E2E, ITL and J/req). A ratio inside the "
        "repeat tolerance of 1 is run-to-run noise, not a difference."),
}


def build_report(settings: Settings, results: Sequence[RequestResult], backend_metrics: dict[str, dict[str, float]],
                 gateway_metrics: dict[str, float], time_scale: float) -> dict[str, Any]:
    """One run: ``{"requests", "errors", "figures", "backends": [{id, hardware, requests, regimes, …}], …}``.

    ``figures`` is `run_figures`. Per backend, κ names as in `router.kappa` (each term in
    `DEFINITIONS`): ``kappa_crit_linear``, ``kappa_crit_p50`` (null when the median request is
    *never* transfer-bound — ``inf``, which JSON lacks — or no request has one),
    ``kappa_crit_never_requests``, ``transfer_share`` (its regimes), ``high_kappa_requests`` (κ_ratio
    above ``high_kappa_threshold``, for ``placement_by_role``) and ``high_kappa_transfer_requests``
    (those of them the gateway also labelled transfer: the two shares reconciled), ``idle`` (no
    request served: every per-request figure null), ``kv_role`` and ``prefills`` (split requests it
    prefilled). ``pd`` is `pd_figures` (null for a fleet that never splits).
    """
    catalog = default_catalog()
    compute_dense = [b for b in settings.backends if b.labels.get("role") == "compute-dense"] or settings.backends
    high_kappa = min(settings.backend_spec(catalog, b).kappa_crit_linear for b in compute_dense)
    ok = [r for r in results if r.error is None]
    large_t = percentile([r.prompt_tokens - r.cached_tokens for r in ok if r.prompt_tokens is not None], 90) or 0
    backends = [_backend_report(settings, catalog, b, [r for r in ok if r.backend == b.id], backend_metrics.get(b.id, {}),
                                time_scale, high_kappa, large_t, sum(r.prefill_backend == b.id for r in ok))
                for b in settings.backends]
    if settings.disaggregated:  # a split's usage counts its pulled KV as cached: the backends' own counts instead
        for b in backends:
            b["prefix_hit_ratio"] = backend_pd_hit(b["id"], ok, backend_metrics.get(b["id"], {}))
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "figures": run_figures(settings, results, backend_metrics, time_scale),
        "high_kappa_threshold": high_kappa, "large_t_threshold_tokens": large_t,
        **_index_report(gateway_metrics),
        "policy": settings.routing.policy, "time_scale": time_scale, "backends": backends,
        "placement_by_role": _placement_by_role(backends),
        "kv_pool_gb": settings.kv_pool.capacity_gb if settings.kv_pool else None,
        "pd": pd_figures(settings, results, gateway_metrics),
    }


def run_figures(settings: Settings, results: Sequence[RequestResult], backend_metrics: dict[str, dict[str, float]],
                time_scale: float) -> dict[str, Any]:
    """The figures one run is compared by (κ beside a baseline, a run beside its repeat).

    Returns:
        ``requests``, ``errors``; ``ttft_p50_s``, ``ttft_p90_s``, ``e2e_p90_s``, ``itl_p50_s`` (modelled
        seconds, successful requests); ``prefix_hit_ratio`` in [0,1] and, on a P/D fleet only,
        ``kv_transferred_tokens`` (both there from `gateway.commands.demo_pd`); ``transfer_share`` in [0,1]
        (of the successful requests that carry ``x-kappa-regime``); ``energy_j`` (the mocks' sum,
        J) and ``energy_per_request_j`` (J per successful request); ``backend_requests`` (backend
        id → successful requests it served, every configured backend listed). Each is null
        when nothing measures it (no successful request, no scraped energy). Terms: `DEFINITIONS`.
    """
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s / time_scale for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s / time_scale for r in ok if r.e2e_s is not None]
    itl = [r.itl_s / time_scale for r in ok if r.itl_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    regimes = [r.regime for r in ok if r.regime is not None]
    energies = [m[ENERGY_METRIC] for m in backend_metrics.values() if ENERGY_METRIC in m]
    energy = sum(energies) if energies else None
    pd = settings.disaggregated
    hit, transferred = (pd_run_hits(settings, ok, backend_metrics) if pd
                        else (sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None, None))
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "e2e_p90_s": percentile(e2e, 90), "itl_p50_s": percentile(itl, 50),
        "prefix_hit_ratio": hit, **({"kv_transferred_tokens": transferred} if pd else {}),
        "transfer_share": regimes.count("transfer") / len(regimes) if regimes else None,
        "energy_j": energy, "energy_per_request_j": energy / len(ok) if energy is not None and ok else None,
        "backend_requests": {b.id: sum(r.backend == b.id for r in ok) for b in settings.backends},
    }


def _backend_report(settings: Settings, catalog: Catalog, b: BackendEntry, mine: list[RequestResult],
                    metrics: dict[str, float], time_scale: float, high_kappa: float, large_t: float,
                    prefills: int) -> dict[str, Any]:
    """One backend's entry of `build_report`'s ``backends``, from its successful requests ``mine`` (a split
    request's is its decode backend's) and the ``prefills`` it ran for split requests."""
    kappas = [r.kappa_ratio for r in mine if r.kappa_ratio is not None]
    loaded = [r.kappa_ratio_loaded for r in mine if r.kappa_ratio_loaded is not None]
    crits = [r.kappa_crit for r in mine if r.kappa_crit is not None]
    transfer = sum(r.regime == "transfer" for r in mine)
    crit_p50 = statistics.median_low(crits) if crits else None
    ttfts = [r.ttft_s / time_scale for r in mine if r.ttft_s is not None]
    e2es = [r.e2e_s / time_scale for r in mine if r.e2e_s is not None]
    itls = [r.itl_s / time_scale for r in mine if r.itl_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in mine)
    cached = sum(r.cached_tokens or 0 for r in mine)
    energy = metrics.get(ENERGY_METRIC)
    high = [r for r in mine if r.kappa_ratio is not None and r.kappa_ratio > high_kappa]
    return {
        "id": b.id, "hardware": f"{b.hardware} x{b.tensor_parallel}"
                                + (f" capped {b.power_cap_w:g} W" if b.power_cap_w else ""),
        "role": b.labels.get("role", ""), "kv_role": b.kv_role, "kappa_crit_linear": settings.backend_spec(catalog, b).kappa_crit_linear,
        "requests": len(mine), "idle": not mine,
        "regimes": {"compute": sum(r.regime == "compute" for r in mine), "transfer": transfer},
        "transfer_share": transfer / len(mine) if mine else None,
        "kappa_ratio_p50": percentile(kappas, 50), "kappa_ratio_p90": percentile(kappas, 90),
        "kappa_ratio_loaded_p50": percentile(loaded, 50), "kappa_ratio_loaded_p90": percentile(loaded, 90),
        "kappa_crit_p50": None if crit_p50 is None or math.isinf(crit_p50) else crit_p50,
        "kappa_crit_never_requests": sum(math.isinf(c) for c in crits),
        "high_kappa_requests": len(high),
        "high_kappa_transfer_requests": sum(r.regime == "transfer" for r in high),
        "large_t_requests": sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) >= large_t for r in mine),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "e2e_p90_s": percentile(e2es, 90), "itl_p50_s": percentile(itls, 50),
        "prefix_hit_ratio": cached / prompt if prompt else None,
        "energy_j": energy, "energy_per_request_j": energy / len(mine) if energy is not None and mine else None,
        "kv_pool_loaded_bytes": metrics.get("mock_vllm:kv_pool_loaded_bytes_total"),
        "prefills": prefills,
    }


def _placement_by_role(backends: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per role (or backend id without one): its requests, the split requests its backends prefilled
    (``prefills``), and the high-κ and large-T shares of its requests (`DEFINITIONS`; null for a role
    that served no request whole or decoded: a prefill-only role has prefills and no shares)."""
    placement: dict[str, dict[str, Any]] = {}
    for b in backends:
        group = placement.setdefault(b["role"] or b["id"], {"requests": 0, "prefills": 0, "high_kappa": 0, "large_t": 0})
        group["requests"] += b["requests"]
        group["prefills"] += b["prefills"]
        group["high_kappa"] += b["high_kappa_requests"]
        group["large_t"] += b["large_t_requests"]
    for group in placement.values():
        n = group["requests"]
        group["high_kappa_share"] = group.pop("high_kappa") / n if n else None
        group["large_t_share"] = group.pop("large_t") / n if n else None
    return placement


def _index_report(gateway_metrics: dict[str, float]) -> dict[str, Any]:
    """How well the prefix index predicted cached tokens, from the gateway's counters."""
    estimated = gateway_metrics.get("gateway_cached_tokens_estimated_total", 0.0)
    reported = gateway_metrics.get("gateway_cached_tokens_reported_total", 0.0)
    predictions = {outcome: int(gateway_metrics.get(f'gateway_index_predictions_total{{outcome="{outcome}"}}', 0.0))
                   for outcome in ("within_one_block", "over", "under")}
    answered = sum(predictions.values())
    return {
        "index_cached_tokens_estimated": estimated, "index_cached_tokens_reported": reported,
        # answers with usage whose predicted K was within one index block of the reported cached_tokens
        "index_within_one_block_share": predictions["within_one_block"] / answered if answered else None,
        "index_predictions": predictions,
        "index_resets": int(gateway_metrics.get("gateway_index_resets_total", 0.0)),
    }
