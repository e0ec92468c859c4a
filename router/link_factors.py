"""A backend's measured factors, one per resource, and the spec the router prices it with.

A factor is measured over profiled seconds of one resource (`router.kappa_fit`): ``compute``
(u: C_eff,measured = C_eff / u), ``host_link`` (the host tier → HBM link), ``kv_pool_link``
(the fleet-shared KV pool → HBM link), ``hbm`` (HBM reads). 1 is the profile; 2 takes twice as
long. A P/D link's factor (``pd_transfer``) is measured apart, from the decode engines' transfer
metrics (`gateway.backends.pd_links`), and blended the same way (`measured_link`), its transfers
as its evidence.

**Blending** (`routed_factors`). The router does not jump to a measured factor: the profile is a
prior worth ``prior_requests`` requests of evidence (`MeasurementSettings`), and in log space

    log f_routed = n / (n + n0) · log f_measured

with n the factor's evidence (its requests, each weighted by age and by the robust fit,
`FactorEstimate.evidence`) and n0 = ``prior_requests``, once its 95% interval excludes 1 (until then
the profile is not contradicted: seen in the simulator with the profile right, a compute factor
read 1.18 [0.94, 1.48] from 18 requests before settling at 1.000). With n0 = 2, the two requests a link
needs to be measured at all move it a half of the way (in log), eight 80%, twenty 91%. A factor
whose blend is within ``resolution`` of 1 (the fit's own resolution, 1%) is 1 exactly — the
profile is not contradicted, so decisions stay those of the profile — and a blend is rounded to
``resolution`` steps (in log), so a figure that wobbles in its last digits does not make a new
spec every scrape.

**The spec** (`measured_spec`): the profile's `router.cost.BackendSpec` with its host and pool
links divided by their factors and its compute and HBM time ratios set; the profile's own object
when every factor is 1 (`fleet_config` interns specs and `router.candidates` keys a request's
predictions on their identity).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from router.cost import BackendSpec
from router.links import Link
from router.profiles import GB

COMPUTE, HOST, POOL, HBM = 0, 1, 2, 3
FACTORS = ("compute", "host_link", "kv_pool_link", "hbm")
"""The factors' names, indexed by COMPUTE, HOST, POOL, HBM (``/v1/kappa/backends``, metrics)."""
DEFAULT_PRIOR_REQUESTS = 2.0
DEFAULT_RESOLUTION = 0.01  # the fit's own resolution (`router.kappa_fit.RELATIVE_NOISE_FLOOR`)
DEFAULT_TIME_CONSTANT_S = 600.0  # ten minutes: a link that degrades is followed within a few
DEFAULT_DEVIATION_RATIO = 1.5  # a datasheet 50% off (either way) is worth telling the operator


@dataclass(frozen=True, slots=True)
class FactorEstimate:
    """One measured factor.

    Attributes:
        time_ratio: measured over profiled seconds (> 0).
        ci_low, ci_high: its 95% interval (asymptotic: `router.kappa_fit`).
        requests: requests bound by this resource in the intervals the fit kept.
        evidence: the same, each weighted by its interval's age and robust weight (≤ requests).
    """

    time_ratio: float
    ci_low: float
    ci_high: float
    requests: int
    evidence: float


class KappaEstimate(NamedTuple):
    """A measured linear κ_crit at one link and its 95% interval (dimensionless)."""

    value: float
    ci_low: float
    ci_high: float


class LinkFactorEstimates(NamedTuple):
    """One estimate per factor; None: no evidence (no request was bound by that resource)."""

    compute: FactorEstimate | None = None
    host_link: FactorEstimate | None = None
    kv_pool_link: FactorEstimate | None = None
    hbm: FactorEstimate | None = None


class LinkFactors(NamedTuple):
    """The factors the router prices a backend with (time ratios, 1 = the profile)."""

    compute: float = 1.0
    host_link: float = 1.0
    kv_pool_link: float = 1.0
    hbm: float = 1.0


PROFILE = LinkFactors()
# Evidence (requests) a factor needs before routing moves on it, by COMPUTE, HOST, POOL, HBM: compute-
# and HBM-bound prefills are plentiful, and a handful of them can be misattributed (live, at a mock
# time scale of 0.0005, a GH200 read compute 1.49 [1.05, 2.10] from 9 requests, its config right);
# load-bound ones are scarce, and each measures its link on its own.
MIN_ROUTED_EVIDENCE = (16.0, 2.0, 2.0, 16.0)


@dataclass(frozen=True, slots=True)
class MeasurementSettings:
    """How measurement moves the router off the profile (module docstring); the config's
    ``routing.measured_figures`` (`fleet_config.sections.MeasuredFiguresSection`).

    Attributes:
        enabled: route on the blended factors (False: on the profile, as before measurement;
            the fit still runs and is reported).
        prior_requests: n0, the profile's worth in requests of evidence (≥ 0; 0: the measured factor as is).
        resolution: relative distance from 1 under which a factor is 1, and its rounding step (≥ 0).
        time_constant_s: τ of the fit's evidence weights exp(−age / τ), s (`router.kappa_fit`).
        deviation_ratio: a factor measured beyond this many times the profile's (either way) is
            reported to the operator (`deviations`), > 1.
    """

    enabled: bool = True
    prior_requests: float = DEFAULT_PRIOR_REQUESTS
    resolution: float = DEFAULT_RESOLUTION
    time_constant_s: float = DEFAULT_TIME_CONSTANT_S
    deviation_ratio: float = DEFAULT_DEVIATION_RATIO


def blended(estimate: FactorEstimate | None, blend: MeasurementSettings) -> float:
    """The factor the router uses for one measured one (module docstring); 1 without evidence."""
    if estimate is None or estimate.evidence <= 0 or estimate.ci_low <= 1.0 <= estimate.ci_high:
        return 1.0
    n = estimate.evidence
    log_f = n / (n + blend.prior_requests) * math.log(estimate.time_ratio)
    step = math.log1p(blend.resolution)
    if step <= 0:
        return math.exp(log_f)
    if abs(log_f) < step:
        return 1.0
    return math.exp(round(log_f / step) * step)


def routed_factors(estimates: LinkFactorEstimates | None, blend: MeasurementSettings) -> LinkFactors:
    """Every factor blended (`blended`) once its evidence reaches `MIN_ROUTED_EVIDENCE`; the profile's
    without a measurement."""
    if estimates is None:
        return PROFILE
    return LinkFactors(*(blended(e, blend) if e is not None and e.evidence >= least else 1.0
                         for e, least in zip(estimates, MIN_ROUTED_EVIDENCE, strict=True)))


@functools.lru_cache(maxsize=1024)
def measured_spec(profile: BackendSpec, factors: LinkFactors) -> BackendSpec:
    """``profile`` priced at ``factors``: links divided by theirs, compute and HBM time ratios set;
    ``profile`` itself when every factor is 1. A pool factor on a backend without a pool is ignored.
    Interned: backends of one profile measured alike share one object (`router.candidates`)."""
    if factors == PROFILE:
        return profile
    host, pool = profile.host_link_gb_s, profile.kv_pool_link_gb_s
    if factors.host_link != 1.0:
        host = profile.link_bytes_per_s / factors.host_link / GB
    if pool is not None and factors.kv_pool_link != 1.0:
        pool = pool / factors.kv_pool_link
    return replace(profile, host_link_gb_s=host, kv_pool_link_gb_s=pool,
                   compute_time_ratio=profile.compute_time_ratio * factors.compute,
                   hbm_time_ratio=profile.hbm_time_ratio * factors.hbm)


def deviations(estimates: LinkFactorEstimates | None, ratio: float) -> dict[str, float]:
    """The measured factors outside [1 / ratio, ratio] of the profile, by name (`FACTORS`): what
    the operator is told (the datasheet lies by more than ``ratio``). Only factors whose whole 95%
    interval is outside count, so a factor measured from two requests does not cry wolf."""
    if estimates is None:
        return {}
    out = {}
    for name, e in zip(FACTORS, estimates, strict=True):
        if e is not None and (e.ci_low > ratio or e.ci_high < 1 / ratio):
            out[name] = e.time_ratio
    return out


def measured_link(configured: Link, delivered_bytes_per_s: float | None, transfers: int,
                  settings: MeasurementSettings) -> Link:
    """A P/D link priced at its blended factor: ``configured`` with its bandwidth divided by
    ``blended(configured / delivered, evidence = transfers)``; ``configured`` itself without a
    measurement (or with the blend at 1, or measurement disabled)."""
    if not settings.enabled or not delivered_bytes_per_s or transfers <= 0 or not math.isfinite(delivered_bytes_per_s):
        return configured
    ratio = configured.bandwidth_bytes_per_s / delivered_bytes_per_s
    factor = blended(FactorEstimate(ratio, ratio, ratio, transfers, float(transfers)), settings)
    if factor == 1.0:
        return configured
    return configured._replace(bandwidth_bytes_per_s=configured.bandwidth_bytes_per_s / factor)
