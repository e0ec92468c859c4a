"""Measured figures of one backend: an online fit of the engine's own prefill times against the cost model.

**Model.** For a request's cached tokens by tier and its T, the cost model predicts its compute
seconds t_c = prefill_flops(K, T) / C_eff, its host-link seconds t_host = host-tier bytes / BW_host,
its KV-pool-link seconds t_pool = pool bytes / BW_pool and its HBM seconds t_h = (weights + KV
read) / HBM bandwidth (`router.cost.roofline`, the formula the mock engine steps by too). Loads
overlap compute (DESIGN.md §3), so its prefill — from the step that first schedules it to its
first token, vLLM's ``vllm:request_prefill_time_seconds`` — takes

    y = max(u · t_c, v_host · t_host + v_pool · t_pool, w · t_h)

where u, v_host, v_pool, w — one factor per resource (`router.link_factors.FACTORS`) — are
measured over predicted seconds: C_eff,measured = C_eff / u, BW_measured = BW / v, and the
linear κ_crit at each link (`router.kappa`, Meng, Lee & Wang, arXiv 2601.19910)

    κ_crit_linear,measured = κ_crit_linear · u / v_host        (the host link)
    κ_crit_linear,pool,measured = κ_M · (BW_pool / C_eff) · u / v_pool

A factor has no unit: a backend whose every second is s times the profile's reads the profile's
κ_crit. A link no load-bound request crossed has no evidence, and says so (its estimate is None).

**What is measured.** vLLM exports prefill times only summed, in a histogram observed when each
request finishes; so each sample is a `PrefillInterval`: the growth of that histogram's sum
between two scrapes, and the predictions for the requests that finished in between
(`dispatch.prefill_feed` decides which intervals are clean). Engine seconds, so neither the
network, nor the client-side tokenisation, nor a busy gateway host enter them.

**Estimation.** Each request is put in the class whose term is largest at the current rates
(compute, load or HBM); an interval's y is then linear in (u, v_host, v_pool, w) — Σ over its
requests of their class's predicted seconds, a load-bound request's split over the two links —
so a least-squares fit through the origin over the intervals gives the rates
(`router.least_squares`: Huber, then Tukey-biweight reweighting, against intervals slowed by a
batch the gateway could not see); classes are redrawn with the new rates until they no longer
change (≤ FIT_ROUNDS). Residuals are relative — each interval divided by its prediction at the
current rates — since an interval's noise grows with its length, and none counts as an outlier
for being within `RELATIVE_NOISE_FLOOR`. Started from the last fit's rates, the profile's and
load rates up to 32× off (`START_LOAD_RATES`), the fit that explains the most intervals (within
`CONSENSUS` of their prediction; of equals, the earliest start), is kept: a profile far off
classifies its load-bound requests as compute-bound at first, and the biweight would otherwise
drop them as outliers for good. The other starts are tried only while some interval is left out.

**Drift.** Intervals are weighted by exp(−age / τ), age from the newest interval (τ:
``time_constant_s``, the caller's setting): a backend that slows down, or a link that degrades,
shows through with that time constant, bounded by the windows kept (`COMPUTE_WINDOW` intervals
without loads, `LOAD_WINDOW` with: load-bound requests are the scarce kind). `reset` (a restart)
forgets everything.

**Confidence.** 95% intervals from the weighted least-squares covariance, by the delta method on
the log (asymptotic: with few requests they are optimistic; the counts are reported beside them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from router import kappa
from router.cost import BackendSpec, roofline
from router.least_squares import RobustFit, robust_least_squares
from router.link_factors import (
    COMPUTE,
    DEFAULT_TIME_CONSTANT_S,
    HBM,
    HOST,
    POOL,
    FactorEstimate,
    KappaEstimate,
    LinkFactorEstimates,
)

COMPUTE_WINDOW = 128  # latest intervals without a load kept (plentiful: at 1 s scrapes, two minutes)
LOAD_WINDOW = 64  # latest intervals with a load kept (scarce: they stay longer)
MIN_REQUESTS = (8, 2, 2, 2)  # per factor (COMPUTE, HOST, POOL, HBM): a load-bound request measures v once u
# is known, two check each other; compute-bound ones vary more (decodes share their steps)
FIT_ROUNDS = 6
# Starting load rates (u = w = 1): the profile's, and up to 32× off either way (a datasheet peak
# against a sustained figure is 4×, a link falling back to TCP 30×); the start whose fit leaves the
# most intervals explained wins (module docstring). The others are tried only while the best so far
# leaves an interval out, or fits no better than GOOD_FIT_SCALE_RATIO.
START_LOAD_RATES = (1.0, 0.25, 4.0, 0.125, 8.0, 0.5, 2.0, 16.0, 32.0, 0.0625)
GOOD_FIT_SCALE_RATIO = 0.05  # robust scale of the relative residuals
# An interval a fit explains is within this of its prediction: the biweight's limit at the noise floor
# (4.685 × 1%), the same for every start, so a sloppier fit does not explain more by its wider limit.
CONSENSUS = 0.047
# Relative residuals below this are the data's resolution, never outliers (the biweight's limit is
# then 4.685 × 1%): on the mocks decodes sharing a prefill's steps add 0.1–1%.
RELATIVE_NOISE_FLOOR = 0.01
Z_95 = 1.959964
COMPUTE_BOUND, LOAD_BOUND, HBM_BOUND = 0, 1, 2  # a request's class


@dataclass(frozen=True, slots=True)
class PrefillPrediction:
    """What the profile predicts for one request's prefill, s (`router.cost.roofline`).

    Attributes:
        t_compute_s, t_load_s, t_hbm_s: compute, load (host + pool) and HBM seconds.
        kv_pool_load_s: the part of ``t_load_s`` that comes from the fleet's KV pool, s.
    """

    t_compute_s: float
    t_load_s: float
    t_hbm_s: float
    kv_pool_load_s: float = 0.0

    @classmethod
    def of(cls, spec: BackendSpec, *, cached_hbm_tokens: float, cached_host_tokens: float,
           cached_kv_pool_tokens: float, uncached_prompt_tokens: float) -> PrefillPrediction:
        """The prediction for a request with these tokens (≥ 0) on ``spec``.

        Raises:
            ValueError: pool tokens on a backend without a pool link (`router.cost.roofline`).
        """
        c = kappa.model_constants(spec.model)
        cached = cached_hbm_tokens + cached_host_tokens + cached_kv_pool_tokens
        new = max(uncached_prompt_tokens, 1.0)  # vLLM computes at least one token
        pool_bytes = c.kv_bytes(cached_kv_pool_tokens) if cached_kv_pool_tokens else 0.0
        pass_ = roofline(spec, flops=c.prefill_flops(cached, new),
                         hbm_bytes=c.weights_read_bytes(new) + c.kv_bytes(cached + new),
                         host_load_bytes=c.kv_bytes(cached_host_tokens), kv_pool_load_bytes=pool_bytes)
        pool_s = pool_bytes / spec.kv_pool_link_bytes_per_s if pool_bytes else 0.0
        return cls(pass_.compute_s, pass_.load_s, pass_.hbm_s, pool_s)

    @property
    def t_host_load_s(self) -> float:
        """The part of ``t_load_s`` over the host link, s."""
        return max(self.t_load_s - self.kv_pool_load_s, 0.0)

    def columns(self) -> tuple[float, float, float, float]:
        """Predicted seconds by factor, indexed by COMPUTE, HOST, POOL, HBM."""
        return self.t_compute_s, self.t_host_load_s, self.kv_pool_load_s, self.t_hbm_s


@dataclass(frozen=True, slots=True)
class PrefillInterval:
    """The prefills of the requests that finished on a backend between two scrapes.

    Attributes:
        prefill_s: their summed measured prefill time, engine seconds (≥ 0).
        requests: the profile's prediction for each of them (non-empty).
        end_s: when the interval ended, on the caller's clock, s (ages it: module docstring).
    """

    prefill_s: float
    requests: tuple[PrefillPrediction, ...]
    end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KappaCritMeasurement:
    """The fit's answer (`KappaCritFit.measurement`).

    Attributes:
        factors: one estimate per factor, None where no request gave evidence (`LinkFactorEstimates`).
        kappa_crit_linear: measured linear κ_crit at the host link with its 95% interval (None
            without host-link evidence).
        kappa_crit_linear_kv_pool: the same at the KV-pool link (None without pool evidence).
        intervals: intervals fitted (with non-zero weight).
        compute_requests, load_requests: requests of each class in them.
        kv_pool_load_requests: those load-bound requests that loaded mostly from the KV pool.
    """

    factors: LinkFactorEstimates
    kappa_crit_linear: KappaEstimate | None
    kappa_crit_linear_kv_pool: KappaEstimate | None
    intervals: int
    compute_requests: int
    load_requests: int
    kv_pool_load_requests: int


@dataclass
class KappaCritFit:
    """Online fit of one backend's per-resource factors from its prefill intervals (module docstring).

    Args:
        spec: the backend's profile figures (what the factors are relative to).
        time_constant_s: τ of the intervals' weights exp(−age / τ), s (> 0).
    """

    spec: BackendSpec
    time_constant_s: float = DEFAULT_TIME_CONSTANT_S
    _compute: deque[PrefillInterval] = field(default_factory=lambda: deque(maxlen=COMPUTE_WINDOW))
    _loads: deque[PrefillInterval] = field(default_factory=lambda: deque(maxlen=LOAD_WINDOW))
    _version: int = 0
    _cached: tuple[int, KappaCritMeasurement | None] = (-1, None)
    _last_rates: list[float] | None = None

    def observe(self, interval: PrefillInterval) -> bool:
        """Keep an interval (returns False, keeping nothing, for an empty or negative one)."""
        if not interval.requests or not 0.0 <= interval.prefill_s < math.inf:
            return False
        loads = any(r.t_load_s > 0 for r in interval.requests)
        (self._loads if loads else self._compute).append(interval)
        self._version += 1
        return True

    def reset(self) -> None:
        """Forget every interval (the backend restarted: its figures start again from the profile)."""
        self._compute.clear()
        self._loads.clear()
        self._last_rates = None
        self._version += 1

    @property
    def rates(self) -> tuple[float, float, float, float]:
        """The last fit's factors (COMPUTE, HOST, POOL, HBM; the profile's, 1, before any): what the
        caller prices the engine's steps at (`dispatch.prefill_schedule`)."""
        r = self._last_rates
        return (1.0, 1.0, 1.0, 1.0) if r is None else (r[0], r[1], r[2], r[3])

    @property
    def intervals(self) -> int:
        """Intervals held."""
        return len(self._compute) + len(self._loads)

    def kappa_crit(self) -> float | None:
        """The measured linear κ_crit at the host link, or None until both its factors are measured."""
        m = self.measurement()
        return None if m is None or m.kappa_crit_linear is None else m.kappa_crit_linear.value

    def measurement(self) -> KappaCritMeasurement | None:
        """The fit over the intervals held (recomputed only after new ones), or None while fewer
        than MIN_REQUESTS[COMPUTE] compute-bound requests are in intervals the fit kept."""
        if self._cached[0] != self._version:
            self._cached = (self._version, self._fit())
        return self._cached[1]

    def _fit(self) -> KappaCritMeasurement | None:
        intervals = [*self._compute, *self._loads]
        if not intervals:
            return None
        newest = max(iv.end_s for iv in intervals)
        prior = [math.exp(-(newest - iv.end_s) / self.time_constant_s) for iv in intervals]
        starts = ([list(self._last_rates)] if self._last_rates else []) + [
            [1.0, v, v, 1.0] for v in START_LOAD_RATES]
        best: tuple[tuple[int, float], KappaCritMeasurement, list[float]] | None = None
        for start in starts:
            fitted = self._fit_from(intervals, prior, start)
            if fitted is not None and (best is None or fitted[0][0] > best[0][0]):  # ties: the earlier start
                best = fitted
            if best is not None and best[0][0] == len(intervals) and -best[0][1] <= GOOD_FIT_SCALE_RATIO:
                break
        if best is None:
            return None
        # a factor without evidence stays at its start: the profile's 1 is the better guess
        self._last_rates = [rate if f is not None else 1.0 for rate, f in zip(best[2], best[1].factors, strict=True)]
        return best[1]

    def _fit_from(self, intervals: list[PrefillInterval], prior: list[float],
                  rates: list[float]) -> tuple[tuple[int, float], KappaCritMeasurement, list[float]] | None:
        """The fit started from ``rates`` (u, v_host, v_pool, w), its score (intervals it explains, and
        its robust residual scale) and its rates."""
        classes: list[list[int]] | None = None
        fit: RobustFit | None = None
        used: list[int] = []
        for _ in range(FIT_ROUNDS):
            new_classes = [[_class(r, rates) for r in iv.requests] for iv in intervals]
            if new_classes == classes:
                break
            classes = new_classes
            rows = [_row(iv, cls) for iv, cls in zip(intervals, classes, strict=True)]
            used = [k for k in (COMPUTE, HOST, POOL, HBM) if any(row[k] for row in rows)]
            if COMPUTE not in used:
                return None
            # relative residuals: an interval's noise grows with its length (decodes share its steps)
            predicted = [sum(rate * x for rate, x in zip(rates, row, strict=True)) for row in rows]
            fit = robust_least_squares([[row[k] / pred for k in used] for row, pred in zip(rows, predicted, strict=True)],
                                       [iv.prefill_s / pred for iv, pred in zip(intervals, predicted, strict=True)],
                                       min_scale=RELATIVE_NOISE_FLOOR, prior_weights=prior)
            if fit is None:
                return None
            for k, rate in zip(used, fit.beta, strict=True):
                if rate > 0:
                    rates[k] = rate
        if fit is None or classes is None:
            return None
        measurement = self._measurement(intervals, classes, fit, used)
        if measurement is None:
            return None
        explained = sum(1 for iv, row in zip(intervals, rows, strict=True)
                        if abs(iv.prefill_s - (p := sum(r * x for r, x in zip(rates, row, strict=True)))) <= CONSENSUS * p)
        return (explained, -fit.scale), measurement, list(rates)

    def _measurement(self, intervals: list[PrefillInterval], classes: list[list[int]], fit: RobustFit,
                     used: list[int]) -> KappaCritMeasurement | None:
        requests = [0, 0, 0, 0]
        evidence = [0.0, 0.0, 0.0, 0.0]
        kept = pool_loads = 0
        by_class = [0, 0, 0]
        for iv, cls, weight in zip(intervals, classes, fit.weights, strict=True):
            if weight <= 0:
                continue
            kept += 1
            for r, k in zip(iv.requests, cls, strict=True):
                by_class[k] += 1
                for factor in _factors_of(r, k):
                    requests[factor] += 1
                    evidence[factor] += weight
                pool_loads += k == LOAD_BOUND and 2 * r.kv_pool_load_s > r.t_load_s
        estimates: list[FactorEstimate | None] = [None, None, None, None]
        for i, k in enumerate(used):
            rate = fit.beta[i]
            if rate > 0 and requests[k] >= MIN_REQUESTS[k]:
                half = Z_95 * math.sqrt(max(fit.cov[i][i], 0.0)) / rate
                estimates[k] = FactorEstimate(rate, rate * math.exp(-half), rate * math.exp(half), requests[k],
                                              evidence[k])
        if estimates[COMPUTE] is None:
            return None
        factors = LinkFactorEstimates(*estimates)
        spec = self.spec
        pool_scale = spec.kv_pool_link_bytes_per_s / spec.link_bytes_per_s
        return KappaCritMeasurement(
            factors, _kappa(spec.kappa_crit_linear, fit, used, HOST, factors),
            _kappa(spec.kappa_crit_linear * pool_scale, fit, used, POOL, factors) if pool_scale else None,
            kept, by_class[COMPUTE_BOUND], by_class[LOAD_BOUND], pool_loads)


def _kappa(profile: float, fit: RobustFit, used: list[int], link: int,
           factors: LinkFactorEstimates) -> KappaEstimate | None:
    """κ_crit_linear at ``link`` (HOST or POOL): profile · u / v, 95% interval by the delta method on log κ."""
    u, v = factors[COMPUTE], factors[link]
    if u is None or v is None:
        return None
    iu, iv = used.index(COMPUTE), used.index(link)
    ru, rv = u.time_ratio, v.time_ratio
    var_log = fit.cov[iu][iu] / ru**2 + fit.cov[iv][iv] / rv**2 - 2 * fit.cov[iu][iv] / (ru * rv)
    half = Z_95 * math.sqrt(max(var_log, 0.0))
    value = profile * ru / rv
    return KappaEstimate(value, value * math.exp(-half), value * math.exp(half))


def _row(interval: PrefillInterval, classes: list[int]) -> list[float]:
    """The interval's predicted seconds by factor, each request's in its class's factors."""
    row = [0.0, 0.0, 0.0, 0.0]
    for r, k in zip(interval.requests, classes, strict=True):
        columns = r.columns()
        for factor in _factors_of(r, k):
            row[factor] += columns[factor]
    return row


def _factors_of(r: PrefillPrediction, k: int) -> tuple[int, ...]:
    """The factors a request of class ``k`` measures: compute, HBM, or the links it loaded over."""
    if k == COMPUTE_BOUND:
        return (COMPUTE,)
    if k == HBM_BOUND:
        return (HBM,)
    return tuple(f for f, s in ((HOST, r.t_host_load_s), (POOL, r.kv_pool_load_s)) if s > 0)


def _class(r: PrefillPrediction, rates: list[float]) -> int:
    """The term that binds this prefill at these rates: COMPUTE_BOUND, LOAD_BOUND or HBM_BOUND."""
    c, host, pool, h = r.columns()
    scaled = (rates[COMPUTE] * c, rates[HOST] * host + rates[POOL] * pool, rates[HBM] * h)
    return scaled.index(max(scaled))
