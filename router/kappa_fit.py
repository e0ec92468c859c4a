"""Measured κ_crit of one backend: an online fit of the engine's own prefill times against the cost model.

**Which quantity.** The *linear* κ_crit at the backend's host link (`router.kappa`,
Meng, Lee & Wang, arXiv 2601.19910):

    κ_crit_linear = (F_lin / B_kv) · (BW_host / C_eff)

the figure the profiles predict as `router.cost.BackendSpec.kappa_crit_linear`, here with C_eff
and the link bandwidth measured instead of read from the hardware catalog. It is not a
request's attention-aware κ_crit(T) (`router.cost.CostEstimate.kappa_crossover`), which
follows from the same two rates and T.

**Model.** For a request's cached tokens by tier and its T, the cost model predicts its
compute seconds t_c = prefill_flops(K, T) / C_eff, load seconds t_l = host-tier bytes / BW_host
+ pool bytes / BW_pool and HBM seconds t_h = (weights + KV read) / HBM bandwidth
(`router.cost.roofline`, the formula the mock engine steps by too). Loads overlap compute
(DESIGN.md §3), so its prefill — from the step that first schedules it to its first token,
vLLM's ``vllm:request_prefill_time_seconds`` — takes

    y = max(u · t_c, v · t_l, w · t_h)

where u, v, w are measured over predicted time per FLOP, per loaded byte and per HBM byte:
C_eff,measured = C_eff / u, BW_measured = BW / v, and

    κ_crit_linear,measured = κ_crit_linear · u / v.

The ratio has no unit: a backend whose every second is s times the profile's reads the profile's κ_crit.

**What is measured.** vLLM exports prefill times only summed, in a histogram observed when
each request finishes; so each sample is a `PrefillInterval`: the growth of that histogram's
sum between two scrapes, and the predictions for the requests that finished in between
(`gateway.backends.kappa_feed` decides which intervals are clean). Engine seconds, so neither the
network, nor the client-side tokenisation, nor a busy gateway host enter them.

**One load scale for both links.** A request loads over the host link or the fleet's KV pool
link (`router.cost.kv_pool_link_gb_s`); the fit has one v for both: it takes the profile's
two link figures to be off by a common factor. That holds where the host link bounds both (on
a PCIe node the pool link is min(network, host link)). Where the pool link is the network's
(a GH200 behind NVLink-C2C) and its loads all come from the pool, v measures the pool link
and the host-link κ_crit follows from the profile's ratio of the two;
`KappaCritMeasurement.kv_pool_load_requests` says how many load-bound requests were pool loads.

**Estimation.** Each request is put in the class whose term is largest at the current rates;
an interval's y is then linear in (u, v, w) — Σ over its requests of their class's predicted
seconds — so a least-squares fit through the origin over the intervals gives the rates
(`router.least_squares`: Huber, then Tukey-biweight reweighting, against intervals slowed by a
batch the gateway could not see); classes are redrawn with the new rates until they no longer
change (≤ FIT_ROUNDS). Residuals are relative — each interval is divided by its prediction at
the current rates — since an interval's noise grows with its length (every step of a long
prefill also carries the running requests' decodes), and none counts as an outlier for being
within `RELATIVE_NOISE_FLOOR` (the biweight then drops intervals more than ~4.7% off). Started
from the profile's rates and from load rates up to 8× off (`START_LOAD_RATES`), the fit with
the smallest robust residual scale is kept.

**Confidence.** The 95% interval of κ from the weighted least-squares covariance of (u, v)
by the delta method on log κ (an asymptotic interval: with few load-bound requests it is
optimistic; the counts are reported beside it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from router import kappa
from router.cost import BackendSpec, roofline
from router.least_squares import RobustFit, robust_least_squares

INTERVAL_WINDOW = 128  # latest intervals kept (a sliding window: a backend that changes shows through)
MIN_COMPUTE_REQUESTS = 8  # compute-bound requests among the intervals fitted
MIN_LOAD_REQUESTS = 2  # load-bound ones: each measures v on its own once u is known; two check each other
FIT_ROUNDS = 6
# Starting load rates v (u = w = 1): the profile's, and up to 8× off either way; the start whose
# fit leaves the smallest robust residual scale wins (a profile far off classifies badly at first).
# The others are tried only when the profile's start gives a fit, and no better than
# GOOD_FIT_SCALE_RATIO.
START_LOAD_RATES = (1.0, 0.125, 0.25, 0.5, 2.0, 4.0, 8.0)
GOOD_FIT_SCALE_RATIO = 0.05  # robust scale of the relative residuals
# Relative residuals below this are the data's resolution, never outliers (the biweight's limit is
# then 4.685 × 1%): on the mocks decodes sharing a prefill's steps add 0.1–1%; on a GPU, timing
# jitter adds more and the residuals' own scale takes over.
RELATIVE_NOISE_FLOOR = 0.01
Z_95 = 1.959964
COMPUTE, LOAD, HBM = 0, 1, 2


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

    def seconds(self) -> tuple[float, float, float]:
        """(t_compute_s, t_load_s, t_hbm_s), indexed by COMPUTE, LOAD, HBM."""
        return self.t_compute_s, self.t_load_s, self.t_hbm_s


@dataclass(frozen=True, slots=True)
class PrefillInterval:
    """The prefills of the requests that finished on a backend between two scrapes.

    Attributes:
        prefill_s: their summed measured prefill time, engine seconds (≥ 0).
        requests: the profile's prediction for each of them (non-empty).
    """

    prefill_s: float
    requests: tuple[PrefillPrediction, ...]


@dataclass(frozen=True, slots=True)
class KappaCritMeasurement:
    """The fit's answer (`KappaCritFit.measurement`).

    Attributes:
        kappa_crit_linear: measured linear κ_crit at the host link (module docstring).
        ci_low, ci_high: its 95% confidence interval (asymptotic, module docstring).
        compute_time_ratio, load_time_ratio, hbm_time_ratio: u, v, w (measured over predicted
            seconds; w is None when no request was HBM-bound).
        intervals: intervals fitted (with non-zero weight).
        compute_requests, load_requests: requests of each class in them.
        kv_pool_load_requests: those load-bound requests that loaded mostly from the KV pool.
    """

    kappa_crit_linear: float
    ci_low: float
    ci_high: float
    compute_time_ratio: float
    load_time_ratio: float
    hbm_time_ratio: float | None
    intervals: int
    compute_requests: int
    load_requests: int
    kv_pool_load_requests: int


@dataclass
class KappaCritFit:
    """Online fit of one backend's linear κ_crit from its prefill intervals (module docstring).

    Args:
        spec: the backend's profile figures (κ_crit_linear to scale).
    """

    spec: BackendSpec
    _intervals: deque[PrefillInterval] = field(default_factory=lambda: deque(maxlen=INTERVAL_WINDOW))
    _version: int = 0
    _cached: tuple[int, KappaCritMeasurement | None] = (-1, None)

    def observe(self, interval: PrefillInterval) -> bool:
        """Keep an interval (returns False, keeping nothing, for an empty or negative one)."""
        if not interval.requests or not 0.0 <= interval.prefill_s < math.inf:
            return False
        self._intervals.append(interval)
        self._version += 1
        return True

    @property
    def intervals(self) -> int:
        """Intervals held."""
        return len(self._intervals)

    def kappa_crit(self) -> float | None:
        """The measured linear κ_crit, or None until enough requests of both kinds were fitted."""
        m = self.measurement()
        return None if m is None else m.kappa_crit_linear

    def measurement(self) -> KappaCritMeasurement | None:
        """The fit over the intervals held (recomputed only after new ones), or None while
        fewer than MIN_COMPUTE_REQUESTS compute-bound or MIN_LOAD_REQUESTS load-bound requests
        are in intervals the fit kept."""
        if self._cached[0] != self._version:
            self._cached = (self._version, self._fit())
        return self._cached[1]

    def _fit(self) -> KappaCritMeasurement | None:
        intervals = list(self._intervals)
        if not intervals:
            return None
        best = self._fit_from(intervals, [1.0, START_LOAD_RATES[0], 1.0])
        if best is None:  # too few requests of a class as profiled: other starts would only invent some
            return None
        for load_rate in START_LOAD_RATES[1:]:
            if best[0] <= GOOD_FIT_SCALE_RATIO:
                break
            fitted = self._fit_from(intervals, [1.0, load_rate, 1.0])
            if fitted is not None and fitted[0] < best[0]:
                best = fitted
        return best[1]

    def _fit_from(self, intervals: list[PrefillInterval],
                  rates: list[float]) -> tuple[float, KappaCritMeasurement] | None:
        """The fit started from ``rates`` (u, v, w), and its robust residual scale, s."""
        classes: list[list[int]] | None = None
        fit: RobustFit | None = None
        fit_used: list[int] = []
        for _ in range(FIT_ROUNDS):
            new_classes = [[_class(r, rates) for r in iv.requests] for iv in intervals]
            if new_classes == classes:
                break
            classes = new_classes
            rows = [[0.0, 0.0, 0.0] for _ in intervals]
            for row, iv, cls in zip(rows, intervals, classes, strict=True):
                for r, k in zip(iv.requests, cls, strict=True):
                    row[k] += r.seconds()[k]
            used = [k for k in (COMPUTE, LOAD, HBM) if any(row[k] for row in rows)]
            if COMPUTE not in used or LOAD not in used:
                return None
            # relative residuals: an interval's noise grows with its length (decodes share its steps)
            predicted = [sum(rate * x for rate, x in zip(rates, row, strict=True)) for row in rows]
            fit = robust_least_squares([[row[k] / pred for k in used] for row, pred in zip(rows, predicted, strict=True)],
                                       [iv.prefill_s / pred for iv, pred in zip(intervals, predicted, strict=True)],
                                       min_scale=RELATIVE_NOISE_FLOOR)
            if fit is None:
                return None
            for k, rate in zip(used, fit.beta, strict=True):
                if rate > 0:
                    rates[k] = rate
            fit_used = used
        if fit is None or classes is None:
            return None
        kept = [(iv, cls) for iv, cls, w in zip(intervals, classes, fit.weights, strict=True) if w > 0]
        counts = [sum(cls.count(k) for _, cls in kept) for k in (COMPUTE, LOAD)]
        if counts[0] < MIN_COMPUTE_REQUESTS or counts[1] < MIN_LOAD_REQUESTS:
            return None
        iu, iv_ = fit_used.index(COMPUTE), fit_used.index(LOAD)
        u, v = fit.beta[iu], fit.beta[iv_]
        if u <= 0 or v <= 0:
            return None
        var_log = fit.cov[iu][iu] / u**2 + fit.cov[iv_][iv_] / v**2 - 2 * fit.cov[iu][iv_] / (u * v)
        half = Z_95 * math.sqrt(max(var_log, 0.0))
        value = self.spec.kappa_crit_linear * u / v
        pool = sum(1 for iv, cls in kept for r, k in zip(iv.requests, cls, strict=True)
                   if k == LOAD and 2 * r.kv_pool_load_s > r.t_load_s)
        return fit.scale, KappaCritMeasurement(
            kappa_crit_linear=value, ci_low=value * math.exp(-half), ci_high=value * math.exp(half),
            compute_time_ratio=u, load_time_ratio=v, hbm_time_ratio=fit.beta[fit_used.index(HBM)] if HBM in fit_used
            else None, intervals=len(kept), compute_requests=counts[0], load_requests=counts[1],
            kv_pool_load_requests=pool)


def _class(r: PrefillPrediction, rates: list[float]) -> int:
    """The term that binds this prefill at these rates: COMPUTE, LOAD or HBM."""
    scaled = [rate * s for rate, s in zip(rates, r.seconds(), strict=True)]
    return scaled.index(max(scaled))
