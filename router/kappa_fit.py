"""Measured κ_crit of one backend: an online fit of queue-free prefill times against the cost model.

**Which quantity.** The *linear* κ_crit at the backend's host link (`router.kappa`,
Meng, Lee & Wang, arXiv 2601.19910):

    κ_crit_linear = (F_lin / B_kv) · (BW_host / C_eff)

the figure the profiles predict as `router.cost.BackendSpec.kappa_crit_linear`, here with C_eff
and the link bandwidth measured instead of read from the hardware catalog. It is not a
request's attention-aware κ_crit(T) (`router.cost.CostEstimate.kappa_crossover`), which
follows from the same two rates and T.

**Model.** For a request's cached tokens by tier and its T, the cost model predicts compute
seconds t_c = prefill_flops(K, T) / C_eff and load seconds t_l = host-tier bytes / BW_host +
pool bytes / BW_pool (`router.cost.roofline`, the formula the mock engine steps by too). A
prefill with nothing queued ahead of it then takes, from the backend accepting it to its
first token,

    y = a + max(u · t_c, v · t_l)                 (loads overlap compute, DESIGN.md §3)

where a is the fixed part (the engine step it waits for, the network) and u, v are measured
over predicted time per FLOP and per loaded byte: C_eff,measured = C_eff / u,
BW_measured = BW / v, so

    κ_crit_linear,measured = κ_crit_linear · u / v.

The ratio has no unit: a mock running at time scale s has u = v = s and reads its profile's κ_crit.

**One load scale for both links.** A request loads over the host link or the fleet's KV pool
link (`router.cost.kv_pool_link_gb_s`); the fit has one v for both: it takes the profile's
two link figures to be off by a common factor. That holds where the host link bounds both
(on a PCIe node the pool link is min(network, host link)). Where the pool link is the
network's (a GH200 behind NVLink-C2C) and its loads all come from the pool, v measures the
pool link and the host-link κ_crit follows from the profile's ratio of the two links;
`KappaCritMeasurement.kv_pool_load_samples` says how many load samples came from the pool.

**Which samples count** (the gateway passes only prefills with no queue of their own,
`gateway.kappa_feed`):

- *compute-bound*: v·t_l ≤ u·t_c / CLASS_MARGIN; *load-bound*: v·t_l ≥ CLASS_MARGIN · u·t_c,
  with the current fit's u/v (the profile's, 1, before there is one). Between the two the
  max() hides which term binds, so such samples inform neither.
- the HBM floor (weights and KV read / HBM bandwidth) at most half the larger of t_c and t_l:
  a short prefill is bound by HBM, which neither u nor v describes.

**Estimation**, robust to the slow outliers that batching and a busy host make:

- a and u: the Theil–Sen line of y on t_c over the compute-bound samples (Sen 1968: the median
  of pairwise slopes; intercept the median of y − u·t_c);
- v: the median of (y − a) / t_l over the load-bound samples;
- classes redrawn with the new u/v and the fit repeated until they are stable (≤ FIT_ROUNDS).

**Confidence**, distribution-free: Sen's rank interval for u at 97.5% and the
order-statistic interval for the median v at 97.5%, combined (Bonferroni) into an interval
for κ of level ≥ 95%: [κ·u_lo/v_hi, κ·u_hi/v_lo]. With fewer than 8 load-bound samples the
median's interval is [min, max], of coverage 1 − 2^(1−n); ``ci_level`` reports the level
reached (0.725 with 3 samples, 0.95 from 8).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist, median

from router import kappa
from router.cost import BackendSpec, roofline

# Latest samples of each kind kept (a sliding window: a backend that changes shows through).
COMPUTE_WINDOW = 128
LOAD_WINDOW = 64
MIN_COMPUTE_SAMPLES = 8  # a Theil–Sen line wants a few points spread over t_c
MIN_LOAD_SAMPLES = 3  # each load-bound sample measures v on its own (after a)
CLASS_MARGIN = 1.5  # one term at least 1.5× the other: which one binds is then not in doubt
HBM_FLOOR_SHARE = 0.5  # the HBM floor at most half of max(t_c, t_l)
FIT_ROUNDS = 4
SIDE_CONFIDENCE = 0.975  # per estimate; two of them give ≥ 95% for κ (Bonferroni)


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One queue-free prefill: its measured first-token time and what the profile predicts.

    Attributes:
        first_token_s: measured time from the backend accepting the request to its first token, s.
        t_compute_s, t_load_s, t_hbm_s: the profile's compute, load (host + pool) and HBM
            seconds for it (`router.cost.roofline`).
        kv_pool_load_s: the part of ``t_load_s`` that comes from the fleet's KV pool, s.
    """

    first_token_s: float
    t_compute_s: float
    t_load_s: float
    t_hbm_s: float
    kv_pool_load_s: float = 0.0

    @classmethod
    def of(cls, spec: BackendSpec, *, cached_hbm_tokens: float, cached_host_tokens: float,
           cached_kv_pool_tokens: float, uncached_prompt_tokens: float, first_token_s: float) -> PrefillSample:
        """The sample of a request with these tokens (≥ 0) on ``spec``.

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
        return cls(first_token_s, pass_.compute_s, pass_.load_s, pass_.hbm_s, pool_s)


@dataclass(frozen=True, slots=True)
class KappaCritMeasurement:
    """The fit's answer (`KappaCritFit.measurement`).

    Attributes:
        kappa_crit_linear: measured linear κ_crit at the host link (module docstring).
        ci_low, ci_high: its confidence interval (distribution-free, level ``ci_level``).
        ci_level: coverage of that interval, in (0, 1): ≥ 0.95 from 7 load-bound samples on.
        compute_time_ratio: u, measured over predicted seconds per FLOP (C_eff,measured = C_eff / u).
        load_time_ratio: v, measured over predicted seconds per loaded byte (BW_measured = BW / v).
        overhead_s: a, the fixed part of a first-token time, s.
        compute_samples, load_samples: samples in each class at this fit.
        kv_pool_load_samples: those load-bound samples that loaded mostly from the KV pool.
    """

    kappa_crit_linear: float
    ci_low: float
    ci_high: float
    ci_level: float
    compute_time_ratio: float
    load_time_ratio: float
    overhead_s: float
    compute_samples: int
    load_samples: int
    kv_pool_load_samples: int


@dataclass
class KappaCritFit:
    """Online fit of one backend's linear κ_crit from its queue-free prefills (module docstring).

    Args:
        spec: the backend's profile figures (predictions, and κ_crit_linear to scale).
    """

    spec: BackendSpec
    _compute: deque[PrefillSample] = field(default_factory=lambda: deque(maxlen=COMPUTE_WINDOW))
    _load: deque[PrefillSample] = field(default_factory=lambda: deque(maxlen=LOAD_WINDOW))
    _version: int = 0
    _cached: tuple[int, KappaCritMeasurement | None] = (-1, None)

    def observe(self, sample: PrefillSample) -> bool:
        """Keep a sample if it can inform the fit; returns whether it was kept.

        Samples whose HBM floor binds, or with a non-positive time, are dropped. The rest are
        kept in one of two windows by the profile's prediction (loads or not beside compute);
        `measurement` classifies them again with the fitted rates.
        """
        s = sample
        if not (s.first_token_s > 0 and math.isfinite(s.first_token_s)):
            return False
        if s.t_hbm_s > HBM_FLOOR_SHARE * max(s.t_compute_s, s.t_load_s):
            return False
        (self._load if s.t_load_s * CLASS_MARGIN > s.t_compute_s else self._compute).append(s)
        self._version += 1
        return True

    @property
    def samples(self) -> tuple[int, int]:
        """(samples held without a load that could bind, samples held with one)."""
        return len(self._compute), len(self._load)

    def kappa_crit(self) -> float | None:
        """The measured linear κ_crit, or None until there are enough samples of both kinds."""
        m = self.measurement()
        return None if m is None else m.kappa_crit_linear

    def measurement(self) -> KappaCritMeasurement | None:
        """The fit over the samples held (recomputed only after new samples), or None while there
        are fewer than MIN_COMPUTE_SAMPLES compute-bound or MIN_LOAD_SAMPLES load-bound ones."""
        if self._cached[0] != self._version:
            self._cached = (self._version, self._fit())
        return self._cached[1]

    def _fit(self) -> KappaCritMeasurement | None:
        held = [*self._compute, *self._load]
        ratio = 1.0  # v/u: the profile's until fitted
        result = None
        for _ in range(FIT_ROUNDS):
            compute = [s for s in held if ratio * s.t_load_s * CLASS_MARGIN <= s.t_compute_s]
            load = [s for s in held if ratio * s.t_load_s >= CLASS_MARGIN * s.t_compute_s]
            if len(compute) < MIN_COMPUTE_SAMPLES or len(load) < MIN_LOAD_SAMPLES:
                return None
            line = theil_sen([s.t_compute_s for s in compute], [s.first_token_s for s in compute])
            if line is None or line.slope <= 0:
                return None
            per_load = sorted((s.first_token_s - line.intercept) / s.t_load_s for s in load)
            v = median(per_load)
            if v <= 0:
                return None
            result = (line, per_load, v, compute, load)
            new_ratio = v / line.slope
            if abs(new_ratio / ratio - 1.0) < 1e-9:
                break
            ratio = new_ratio
        assert result is not None
        line, per_load, v, compute, load = result
        v_low, v_high, v_level = median_interval(per_load, SIDE_CONFIDENCE)
        base = self.spec.kappa_crit_linear
        return KappaCritMeasurement(
            kappa_crit_linear=base * line.slope / v,
            ci_low=max(base * line.slope_low / v_high, 0.0) if v_high > 0 else 0.0,
            ci_high=base * line.slope_high / v_low if v_low > 0 else math.inf,
            ci_level=1.0 - (1.0 - SIDE_CONFIDENCE) - (1.0 - v_level),
            compute_time_ratio=line.slope, load_time_ratio=v, overhead_s=line.intercept,
            compute_samples=len(compute), load_samples=len(load),
            kv_pool_load_samples=sum(1 for s in load if s.kv_pool_load_s * 2 > s.t_load_s),
        )


@dataclass(frozen=True, slots=True)
class Line:
    """A fitted line y = intercept + slope·x, with the slope's confidence interval."""

    intercept: float
    slope: float
    slope_low: float
    slope_high: float


def theil_sen(xs: list[float], ys: list[float], confidence: float = SIDE_CONFIDENCE) -> Line | None:
    """Theil–Sen line through (xs, ys) with Sen's rank interval for the slope.

    Slope: the median of the slopes between every pair of points with distinct x; intercept:
    the median of y − slope·x. The interval is Sen's (1968), as ``scipy.stats.theilslopes``
    computes it (ties in x ignored). O(n²) pairs: meant for windows of ~100 points.

    Returns:
        The line, or None when fewer than two distinct x values exist.
    """
    n = len(xs)
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i])
    if not slopes:
        return None
    slope = median(slopes)
    intercept = median(y - slope * x for x, y in zip(xs, ys, strict=True))
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    spread = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    count = len(slopes)
    low = min(max(round((count - spread) / 2.0) - 1, 0), count - 1)
    high = min(max(round((count + spread) / 2.0), 0), count - 1)
    return Line(intercept, slope, slopes[low], slopes[high])


def median_interval(ordered: list[float], confidence: float = SIDE_CONFIDENCE) -> tuple[float, float, float]:
    """Distribution-free interval for the median of sorted values: (low, high, level).

    [x_(k), x_(n−k+1)] with the largest k whose binomial tail P(Bin(n, ½) < k) ≤ (1 − confidence)/2,
    so its coverage is at least ``confidence``; when even [min, max] falls short (n < 8 at
    97.5%) it is [min, max] at its own level 1 − 2^(1−n).

    Raises:
        IndexError: ``ordered`` is empty.
    """
    n = len(ordered)
    alpha_half = (1.0 - confidence) / 2.0
    k, tail = 0, 0.0  # tail = P(Bin(n, ½) ≤ k − 1)
    while k < n // 2:
        next_tail = tail + math.comb(n, k) / 2.0**n
        if next_tail > alpha_half:
            break
        tail, k = next_tail, k + 1
    k = max(k, 1)
    level = 1.0 - 2.0 * (sum(math.comb(n, i) for i in range(k)) / 2.0**n)
    return ordered[k - 1], ordered[n - k], level
