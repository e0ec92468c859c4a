"""A backend's measured figures as ``/v1/kappa/backends`` shows them (`router.kappa_fit`, `dispatch.measured`).

Which samples feed the fit is `dispatch.prefill_feed`'s (shared with the simulator); its names are
re-exported here for the gateway's proxy.
"""

from __future__ import annotations

import math
from typing import Any

from dispatch import Target
from dispatch.measured import MeasuredFigures
from gateway.backends.pd_links import PdLinks
from dispatch.prefill_feed import DispatchTiming, PrefillFeed, single_step_tokens
from router.link_factors import FACTORS, FactorEstimate, KappaEstimate, measured_link

__all__ = ["DispatchTiming", "PrefillFeed", "measured_fields", "single_step_tokens"]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _factor(e: FactorEstimate | None, routed: float) -> dict[str, Any]:
    if e is None:
        return {"evidence": "none", "routed_time_ratio": routed}
    return {"time_ratio": e.time_ratio, "ci": [e.ci_low, _finite(e.ci_high)], "requests": e.requests,
            "evidence_requests": e.evidence, "routed_time_ratio": routed}


def _kappa(k: KappaEstimate | None) -> tuple[float | None, list[float | None] | None]:
    return (None, None) if k is None else (k.value, [k.ci_low, _finite(k.ci_high)])


def _pd_transfer(pd_links: PdLinks | None, backend_id: str, figures: MeasuredFigures) -> dict[str, Any] | None:
    """The P/D links into ``backend_id`` (a decode side) as factors: configured over delivered bandwidth
    (`gateway.backends.pd_links` measures them), by ``"prefill->decode"``; None on an aggregated fleet."""
    if pd_links is None:
        return None
    out: dict[str, Any] = {}
    for r in pd_links.links.values():
        if r.decode_id != backend_id:
            continue
        routed = measured_link(r.configured, r.delivered_bytes_per_s, r.transfers, figures.settings)
        entry: dict[str, Any] = {"routed_time_ratio": r.configured.bandwidth_bytes_per_s / routed.bandwidth_bytes_per_s}
        if r.delivered_bytes_per_s:
            entry |= {"time_ratio": r.configured.bandwidth_bytes_per_s / r.delivered_bytes_per_s,
                      "requests": r.transfers}
        else:
            entry["evidence"] = "none"
        out[f"{r.prefill_id}->{r.decode_id}"] = entry
    return out or None


def measured_fields(target: Target, pd_links: PdLinks | None = None) -> dict[str, Any]:
    """A backend's κ_crit figures: ``kappa_crit_linear`` (its profile's, at the host link),
    ``kappa_crit_linear_routed`` (the spec routing prices it with: the profile blended with the
    measured factors, `dispatch.measured`), ``kappa_crit_linear_measured`` (the linear κ_crit at the host
    link, null until its compute and host-link factors are measured) with its 95%
    ``kappa_crit_linear_measured_ci``; ``kappa_fit``: the intervals held and fitted, requests by
    class, and one entry per factor (``compute``, ``host_link``, ``kv_pool_link``, ``hbm``:
    measured over profiled seconds, 95% interval, requests behind it, their age-weighted evidence,
    and the factor routing uses now; ``{"evidence": "none"}`` where none), the κ_crit at the pool
    link likewise, ``pd_transfer`` (the P/D links into it, `_pd_transfer`; null without)
    and ``routing_on_measured`` (the setting)."""
    figures = target.figures
    fit, m = figures.fit, figures.measurement()
    profile = {"kappa_crit_linear": target.profile_spec.kappa_crit_linear,
               "kappa_crit_linear_routed": target.spec.kappa_crit_linear}
    routed = figures.factors
    out: dict[str, Any] = {"intervals_held": fit.intervals, "routing_on_measured": figures.settings.enabled,
                           "pd_transfer": _pd_transfer(pd_links, target.id, figures)}
    if m is None:
        out["factors"] = {name: _factor(None, r) for name, r in zip(FACTORS, routed, strict=True)}
        return profile | {"kappa_crit_linear_measured": None, "kappa_crit_linear_measured_ci": None, "kappa_fit": out}
    host, host_ci = _kappa(m.kappa_crit_linear)
    pool, pool_ci = _kappa(m.kappa_crit_linear_kv_pool)
    out |= {
        "intervals": m.intervals,
        "requests": {"compute": m.compute_requests, "load": m.load_requests, "kv_pool_load": m.kv_pool_load_requests},
        "factors": {name: _factor(e, r) for name, e, r in zip(FACTORS, m.factors, routed, strict=True)},
        "kappa_crit_linear_kv_pool_measured": pool, "kappa_crit_linear_kv_pool_measured_ci": pool_ci,
    }
    return profile | {"kappa_crit_linear_measured": host, "kappa_crit_linear_measured_ci": host_ci, "kappa_fit": out}
