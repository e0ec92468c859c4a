"""The per-resource fit (`router.kappa_fit`): what it estimates from prefill intervals, and how surely.

Predictions are built as the gateway builds them (`PrefillPrediction.of` on a real profile);
each interval's measured time is the fit's own model, Σ max(u·t_c, v_host·t_host + v_pool·t_pool,
w·t_h), with known factors — so the fit must give them back, and κ_crit_linear · u / v_host.
"""

from __future__ import annotations

import random

import pytest

from fleet_config import default_catalog
from router.cost import BackendSpec
from router.kappa_fit import (
    MIN_REQUESTS,
    KappaCritFit,
    PrefillInterval,
    PrefillPrediction,
)
from router.link_factors import COMPUTE, HOST

MIN_COMPUTE_REQUESTS, MIN_LOAD_REQUESTS = MIN_REQUESTS[COMPUTE], MIN_REQUESTS[HOST]

CATALOG = default_catalog()
# The demo's H100×4 capped at 350 W with a 60 GB/s pool link: κ_crit_linear 19.0 at its 4 × 15 GB/s
# host link, and the same at the pool link (60 GB/s).
H100 = BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4,
                   power_cap_w=350, kv_pool_link_gb_s=60)
H100_POOL_KAPPA = H100.kappa_crit_linear * 60e9 / H100.link_bytes_per_s


def cold(rng: random.Random) -> PrefillPrediction:
    """A new conversation: 512 cached tokens (the system prompt), 500–20,000 new: compute-bound."""
    return PrefillPrediction.of(H100, cached_hbm_tokens=512, cached_host_tokens=0, cached_kv_pool_tokens=0,
                                uncached_prompt_tokens=rng.randint(500, 20_000))


def follow_up(rng: random.Random, *, pool: bool) -> PrefillPrediction:
    """A follow-up of 20–200 new tokens on a 10,000–40,000-token prefix loaded from the host tier or the pool."""
    loaded = rng.randint(10_000, 40_000)
    return PrefillPrediction.of(H100, cached_hbm_tokens=0, cached_host_tokens=0 if pool else loaded,
                                cached_kv_pool_tokens=loaded if pool else 0, uncached_prompt_tokens=rng.randint(20, 200))


def hbm_hit(rng: random.Random) -> PrefillPrediction:
    """A follow-up whose whole prefix is in HBM and that adds 5–20 tokens: the HBM floor binds."""
    return PrefillPrediction.of(H100, cached_hbm_tokens=rng.randint(500, 2_000), cached_host_tokens=0,
                                cached_kv_pool_tokens=0, uncached_prompt_tokens=rng.randint(5, 20))


def measured(requests: list[PrefillPrediction], u: float, v: float, w: float, v_pool: float | None = None) -> float:
    """The fit's model with these factors (``v_pool`` None: the host link's)."""
    vp = v if v_pool is None else v_pool
    return sum(max(u * r.t_compute_s, v * r.t_host_load_s + vp * r.kv_pool_load_s, w * r.t_hbm_s) for r in requests)


def intervals(rng: random.Random, n: int, *, u: float, v: float, w: float = 1.0, load_share: float = 0.15,
              hbm_share: float = 0.2, v_pool: float | None = None) -> list[PrefillInterval]:
    """``n`` intervals of 1–3 finished requests each."""
    out = []
    for _ in range(n):
        requests = []
        for _ in range(rng.randint(1, 3)):
            draw = rng.random()
            requests.append(follow_up(rng, pool=rng.random() < 0.5) if draw < load_share
                            else hbm_hit(rng) if draw < load_share + hbm_share else cold(rng))
        out.append(PrefillInterval(measured(requests, u, v, w, v_pool), tuple(requests)))
    return out


@pytest.mark.parametrize(("u", "v", "w"), [(1.0, 1.0, 1.0), (1.3, 0.7, 1.1), (0.8, 2.5, 1.0), (1.0, 1.0, 2.0)],
                         ids=["as-profiled", "slow-compute-fast-link", "slow-link", "slow-hbm"])
def test_recovers_the_linear_kappa_crit_from_measured_rates(u: float, v: float, w: float) -> None:
    fit = KappaCritFit(H100)
    for interval in intervals(random.Random(7), 60, u=u, v=v, w=w):
        assert fit.observe(interval)
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear is not None
    assert m.kappa_crit_linear.value == pytest.approx(H100.kappa_crit_linear * u / v, rel=1e-6)
    assert [f.time_ratio for f in m.factors] == pytest.approx([u, v, v, w], rel=1e-6)
    assert m.kappa_crit_linear.ci_low == pytest.approx(m.kappa_crit_linear.value)
    assert m.kappa_crit_linear.ci_high == pytest.approx(m.kappa_crit_linear.value)
    assert m.load_requests >= MIN_LOAD_REQUESTS and 0 < m.kv_pool_load_requests < m.load_requests


def test_noise_and_slowed_intervals_stay_within_the_interval() -> None:
    """2% noise on every interval, and one in ten slowed 20–200% by a batch the gateway could
    not see: the biweight drops those, and the 95% interval covers the truth."""
    rng = random.Random(3)
    noisy = []
    for interval in intervals(rng, 150, u=1.0, v=1.0):
        factor = rng.gauss(1.0, 0.02) * (1 + rng.uniform(0.2, 2.0) if rng.random() < 0.1 else 1.0)
        noisy.append(PrefillInterval(interval.prefill_s * factor, interval.requests))
    fit = KappaCritFit(H100)
    for interval in noisy:
        fit.observe(interval)
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear is not None
    value, low, high = m.kappa_crit_linear
    assert value == pytest.approx(H100.kappa_crit_linear, rel=0.05)
    assert low <= H100.kappa_crit_linear <= high
    assert high / low < 1.3
    assert m.intervals < 150  # the slowed ones carry no weight


def test_a_profile_off_by_a_factor_is_reclassified() -> None:
    """Loads 5× slower than profiled make some predicted-compute-bound follow-ups load-bound: once
    the deep follow-ups give a first fit, the classes are redrawn with the fitted rates until they hold."""
    fit = KappaCritFit(H100)
    rng = random.Random(9)
    requests = [PrefillPrediction.of(H100, cached_hbm_tokens=0, cached_host_tokens=rng.randint(3_000, 5_000),
                                     cached_kv_pool_tokens=0, uncached_prompt_tokens=rng.randint(400, 600))
                for _ in range(40)]
    assert all(r.t_load_s < r.t_compute_s for r in requests)  # compute-bound as profiled …
    assert all(5 * r.t_load_s > r.t_compute_s for r in requests)  # … load-bound as they run
    for r in requests:
        fit.observe(PrefillInterval(measured([r], 1.0, 5.0, 1.0), (r,)))
    for interval in intervals(random.Random(10), 30, u=1.0, v=5.0):
        fit.observe(interval)
    m = fit.measurement()
    assert m is not None and m.factors.host_link is not None and m.kappa_crit_linear is not None
    assert m.factors.host_link.time_ratio == pytest.approx(5.0, rel=1e-6)
    assert m.kappa_crit_linear.value == pytest.approx(H100.kappa_crit_linear / 5, rel=1e-6)


def test_each_factor_reports_only_with_enough_requests_of_its_kind() -> None:
    rng = random.Random(5)
    fit = KappaCritFit(H100)
    assert fit.measurement() is None  # nothing yet
    computes = [cold(rng) for _ in range(MIN_COMPUTE_REQUESTS)]
    loads = [follow_up(rng, pool=False) for _ in range(MIN_LOAD_REQUESTS)]
    for r in computes[:-1]:
        fit.observe(PrefillInterval(measured([r], 1, 1, 1), (r,)))
    assert fit.measurement() is None  # one compute-bound request short
    for r in computes[-1:] + loads[:-1]:
        fit.observe(PrefillInterval(measured([r], 1, 1, 1), (r,)))
    m = fit.measurement()
    assert m is not None and m.factors.compute is not None and m.factors.compute.requests == MIN_COMPUTE_REQUESTS
    assert m.factors.host_link is None and fit.kappa_crit() is None  # one load-bound request short: no evidence
    fit.observe(PrefillInterval(measured([loads[-1]], 1, 1, 1), (loads[-1],)))
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear is not None and fit.kappa_crit() == m.kappa_crit_linear.value
    assert (m.compute_requests, m.load_requests) == (MIN_COMPUTE_REQUESTS, MIN_LOAD_REQUESTS)
    assert (m.factors.kv_pool_link, m.factors.hbm, m.kappa_crit_linear_kv_pool) == (None, None, None)


def test_time_scale_cancels() -> None:
    """A backend (or a mock) whose every second is 0.4 of the profile's reads the profile's κ_crit."""
    fit = KappaCritFit(H100)
    for interval in intervals(random.Random(13), 40, u=0.4, v=0.4, w=0.4):
        fit.observe(interval)
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear is not None
    assert m.kappa_crit_linear.value == pytest.approx(H100.kappa_crit_linear, rel=1e-6)


@pytest.mark.parametrize("prefill_s", [-1.0, float("inf"), float("nan")], ids=["negative", "inf", "nan"])
def test_refuses_impossible_intervals(prefill_s: float) -> None:
    fit = KappaCritFit(H100)
    r = cold(random.Random(1))
    assert not fit.observe(PrefillInterval(prefill_s, (r,)))
    assert not fit.observe(PrefillInterval(1.0, ()))
    assert fit.intervals == 0


def test_one_slowed_load_interval_among_few_does_not_take_the_others_out() -> None:
    """Seen on the demo's GH200: five load-bound requests, one of them in an interval slowed 68% by a
    batch the gateway could not see, everything else within 0.1%. Ordinary least squares, where the
    biweight used to start, pulled the load rate so far that all five fell outside its limit and
    the system turned singular: no measurement at all. The Huber stage keeps the four."""
    rng = random.Random(21)
    fit = KappaCritFit(H100)
    for _ in range(40):
        r = cold(rng)
        fit.observe(PrefillInterval(measured([r], 1, 1, 1) * rng.uniform(1.0, 1.001), (r,)))
    loads = [follow_up(rng, pool=True) for _ in range(5)]
    for k, r in enumerate(loads):
        fit.observe(PrefillInterval(measured([r], 1, 1, 1) * (1.68 if k == 2 else rng.uniform(1.0, 1.001)), (r,)))
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear_kv_pool is not None
    assert m.kappa_crit_linear_kv_pool.value == pytest.approx(H100_POOL_KAPPA, rel=0.005)
    assert m.load_requests == 4


def test_noise_in_proportion_to_an_interval_is_not_an_outlier() -> None:
    """Residuals are relative: an interval of a few prefills 0.3% long is as good as a single short
    one 0.03% long (decodes share every step, so noise grows with the time). Absolute residuals
    took the longer ones for outliers whenever the short ones fitted to a tenth of a millisecond,
    and with them the load-bound requests they held (seen on the demo's B200s)."""
    rng = random.Random(4)
    fit = KappaCritFit(H100)
    for _ in range(40):
        short = PrefillPrediction.of(H100, cached_hbm_tokens=512, cached_host_tokens=0, cached_kv_pool_tokens=0,
                                     uncached_prompt_tokens=rng.randint(300, 600))
        fit.observe(PrefillInterval(measured([short], 1, 1, 1) * rng.uniform(0.9997, 1.0003), (short,)))
    for _ in range(4):
        requests = (PrefillPrediction.of(H100, cached_hbm_tokens=512, cached_host_tokens=0, cached_kv_pool_tokens=0,
                                         uncached_prompt_tokens=rng.randint(1_000, 3_000)), follow_up(rng, pool=False))
        fit.observe(PrefillInterval(measured(list(requests), 1, 1, 1) * rng.uniform(0.997, 1.003), requests))
    m = fit.measurement()
    assert m is not None and m.load_requests == 4 and m.intervals == 44 and m.kappa_crit_linear is not None
    assert m.kappa_crit_linear.value == pytest.approx(H100.kappa_crit_linear, rel=0.02)


@pytest.mark.parametrize(("u", "v_host", "v_pool"), [(1.0, 5.0, 1.0), (1.0, 1.0, 0.2), (1.2, 3.0, 0.5)],
                         ids=["slow-host-link", "fast-pool-link", "all-off"])
def test_the_host_and_pool_links_are_measured_apart(u: float, v_host: float, v_pool: float) -> None:
    """Issue 29: one load factor for both links read the capped H100 at 2.97 where the truth was 22,
    its host-tier and pool links being 5× apart. Each link now has its own factor and κ_crit."""
    fit = KappaCritFit(H100)
    for interval in intervals(random.Random(17), 80, u=u, v=v_host, v_pool=v_pool, load_share=0.3):
        fit.observe(interval)
    m = fit.measurement()
    assert m is not None and m.factors.host_link is not None and m.factors.kv_pool_link is not None
    assert (m.factors.host_link.time_ratio, m.factors.kv_pool_link.time_ratio) == pytest.approx((v_host, v_pool),
                                                                                                rel=1e-6)
    assert m.kappa_crit_linear is not None and m.kappa_crit_linear_kv_pool is not None
    assert m.kappa_crit_linear.value == pytest.approx(H100.kappa_crit_linear * u / v_host, rel=1e-6)
    assert m.kappa_crit_linear_kv_pool.value == pytest.approx(H100_POOL_KAPPA * u / v_pool, rel=1e-6)


def test_a_pool_only_backend_has_no_host_link_evidence() -> None:
    """Loads only from the pool: the pool link is measured, the host link says it has no evidence."""
    rng = random.Random(19)
    fit = KappaCritFit(H100)
    for _ in range(30):
        requests = [cold(rng), follow_up(rng, pool=True)]
        fit.observe(PrefillInterval(measured(requests, 1.0, 1.0, 1.0, v_pool=2.0), tuple(requests)))
    m = fit.measurement()
    assert m is not None and m.factors.host_link is None and m.kappa_crit_linear is None
    assert m.factors.kv_pool_link is not None and m.factors.kv_pool_link.time_ratio == pytest.approx(2.0, rel=1e-6)
    assert m.factors.kv_pool_link.requests == 30 and m.factors.kv_pool_link.evidence == pytest.approx(30)


def test_old_evidence_ages_with_the_time_constant() -> None:
    """A link that degrades: 60 intervals at v = 1, then 60 at v = 3, ten time constants later. The fit
    follows the new figure; the old intervals weigh exp(−10) each in the evidence."""
    tau = 100.0
    fit = KappaCritFit(H100, time_constant_s=tau)
    for k, interval in enumerate(intervals(random.Random(23), 60, u=1.0, v=1.0, load_share=0.4)):
        fit.observe(PrefillInterval(interval.prefill_s, interval.requests, end_s=float(k)))
    for k, interval in enumerate(intervals(random.Random(29), 60, u=1.0, v=3.0, load_share=0.4)):
        fit.observe(PrefillInterval(interval.prefill_s, interval.requests, end_s=1_000.0 + k))
    m = fit.measurement()
    assert m is not None and m.factors.host_link is not None
    assert m.factors.host_link.time_ratio == pytest.approx(3.0, rel=0.01)
    new_loads = sum(1 for iv in intervals(random.Random(29), 60, u=1.0, v=3.0, load_share=0.4)
                    for r in iv.requests if r.t_host_load_s > 0 and r.t_load_s > r.t_compute_s)
    assert m.factors.host_link.evidence < new_loads + 1  # the old ones count e^-10 each


def test_a_reset_forgets_everything() -> None:
    fit = KappaCritFit(H100)
    for interval in intervals(random.Random(31), 40, u=1.0, v=2.0):
        fit.observe(interval)
    assert fit.measurement() is not None
    fit.reset()
    assert fit.intervals == 0 and fit.measurement() is None
