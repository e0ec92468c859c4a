"""The κ_crit fit (`router.kappa_fit`): which samples count, what it estimates, how sure it is.

Samples are built the way the gateway builds them (`PrefillSample.of` on a real profile) and
timed by the fit's own model, y = a + max(u·t_c, v·t_l), with known u, v and a; the fit must
give back κ_crit_linear · u / v.
"""

from __future__ import annotations

import math
import random

import pytest

from fleet_config import default_catalog
from router.cost import BackendSpec
from router.kappa_fit import (
    MIN_COMPUTE_SAMPLES,
    MIN_LOAD_SAMPLES,
    KappaCritFit,
    PrefillSample,
    median_interval,
    theil_sen,
)

CATALOG = default_catalog()
# The demo's H100×4 capped at 350 W with a 60 GB/s pool link: κ_crit_linear 19.0.
H100 = BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4,
                   power_cap_w=350, kv_pool_link_gb_s=60)


def sample(*, new: int, host: int = 0, pool: int = 0, hbm: int = 512, u: float, v: float, a: float,
           noise_s: float = 0.0) -> PrefillSample:
    shape = PrefillSample.of(H100, cached_hbm_tokens=hbm, cached_host_tokens=host, cached_kv_pool_tokens=pool,
                             uncached_prompt_tokens=new, first_token_s=1.0)
    y = a + max(u * shape.t_compute_s, v * shape.t_load_s) + noise_s
    return PrefillSample(y, shape.t_compute_s, shape.t_load_s, shape.t_hbm_s, shape.kv_pool_load_s)


def traffic(rng: random.Random, *, u: float, v: float, a: float, n_compute: int, n_load: int,
            noise_s: float = 0.0, pool_share: float = 0.5) -> list[PrefillSample]:
    """Cold prompts of 500–20,000 tokens and follow-ups of 20–200 new tokens on a 5,000–40,000-token
    prefix loaded from the host tier or the pool; Gaussian noise of ``noise_s``."""
    out = [sample(new=rng.randint(500, 20_000), u=u, v=v, a=a, noise_s=rng.gauss(0, noise_s))
           for _ in range(n_compute)]
    for _ in range(n_load):
        loaded = rng.randint(5_000, 40_000)
        tier = {"pool": loaded} if rng.random() < pool_share else {"host": loaded}
        out.append(sample(new=rng.randint(20, 200), u=u, v=v, a=a, noise_s=rng.gauss(0, noise_s), **tier))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize(("u", "v"), [(1.0, 1.0), (0.4, 0.4), (1.3, 0.7), (0.8, 2.5)],
                         ids=["as-profiled", "time-scaled-mock", "slow-compute-fast-link", "slow-link"])
def test_recovers_the_linear_kappa_crit_from_measured_rates(u: float, v: float) -> None:
    fit = KappaCritFit(H100)
    for s in traffic(random.Random(7), u=u, v=v, a=0.012, n_compute=40, n_load=10):
        fit.observe(s)
    m = fit.measurement()
    assert m is not None
    assert m.kappa_crit_linear == pytest.approx(H100.kappa_crit_linear * u / v, rel=1e-6)
    assert (m.compute_time_ratio, m.load_time_ratio, m.overhead_s) == pytest.approx((u, v, 0.012), rel=1e-6)
    assert m.ci_low == pytest.approx(m.kappa_crit_linear) and m.ci_high == pytest.approx(m.kappa_crit_linear)
    assert MIN_LOAD_SAMPLES <= m.load_samples <= 10  # a faster link leaves some follow-ups compute-bound
    assert 0 < m.kv_pool_load_samples < m.load_samples


def test_noise_and_slow_outliers_stay_within_the_interval() -> None:
    """5 ms of jitter and one sample in eight held up 50–500 ms (a batch it shared, a busy host)."""
    rng = random.Random(3)
    u, v = 0.4, 0.4
    samples = traffic(rng, u=u, v=v, a=0.015, n_compute=100, n_load=24, noise_s=0.005)
    samples = [PrefillSample(s.first_token_s + (rng.uniform(0.05, 0.5) if rng.random() < 0.125 else 0.0),
                             s.t_compute_s, s.t_load_s, s.t_hbm_s, s.kv_pool_load_s) for s in samples]
    fit = KappaCritFit(H100)
    for s in samples:
        fit.observe(s)
    m = fit.measurement()
    assert m is not None
    assert m.kappa_crit_linear == pytest.approx(H100.kappa_crit_linear, rel=0.1)
    assert m.ci_low <= H100.kappa_crit_linear <= m.ci_high
    assert m.ci_level >= 0.95
    assert m.ci_high / m.ci_low < 1.5


def test_reports_only_with_enough_samples_of_both_kinds() -> None:
    rng = random.Random(5)
    fit = KappaCritFit(H100)
    compute = traffic(rng, u=1, v=1, a=0.01, n_compute=MIN_COMPUTE_SAMPLES, n_load=0)
    loads = [s for s in traffic(rng, u=1, v=1, a=0.01, n_compute=0, n_load=MIN_LOAD_SAMPLES)]
    for s in compute[:-1] + loads:
        fit.observe(s)
    assert fit.measurement() is None and fit.kappa_crit() is None  # one compute-bound sample short
    fit.observe(compute[-1])
    m = fit.measurement()
    assert m is not None and fit.kappa_crit() == m.kappa_crit_linear
    # With 3 load-bound samples the median's interval is [min, max]: coverage 1 − 2^(1−3) = 0.75.
    assert m.ci_level == pytest.approx(0.975 - 0.25)


@pytest.mark.parametrize(
    ("new", "host", "kept"),
    [
        (20, 0, False),  # 20 new tokens next to 512 cached: the weights read from HBM bounds it
        (2_000, 0, True),  # compute-bound
        (300, 6_000, True),  # ambiguous at intake (t_l ≈ 0.94 t_c): kept for the fit to classify
        (50, 30_000, True),  # load-bound
    ],
    ids=["hbm-floor", "compute", "ambiguous", "load"],
)
def test_which_samples_are_kept(new: int, host: int, kept: bool) -> None:
    fit = KappaCritFit(H100)
    assert fit.observe(sample(new=new, host=host, u=1, v=1, a=0.01)) is kept


def test_ambiguous_samples_inform_neither_rate() -> None:
    """Samples where t_l ≈ t_c are timed 10× too slow: the fit must not use them."""
    rng = random.Random(11)
    fit = KappaCritFit(H100)
    for s in traffic(rng, u=1, v=1, a=0.01, n_compute=30, n_load=8):
        fit.observe(s)
    for _ in range(20):
        s = sample(new=300, host=6_000, u=1, v=1, a=0.01)
        assert 0.8 < s.t_load_s / s.t_compute_s < 1.25
        fit.observe(PrefillSample(10 * s.first_token_s, s.t_compute_s, s.t_load_s, s.t_hbm_s))
    m = fit.measurement()
    assert m is not None and m.kappa_crit_linear == pytest.approx(H100.kappa_crit_linear, rel=1e-6)


def test_time_unit_cancels() -> None:
    """A mock at time scale 0.4 runs every second 2.5× fast: κ_crit is unchanged."""
    rng = random.Random(13)
    fits = []
    for scale in (1.0, 0.4):
        fit = KappaCritFit(H100)
        for s in traffic(rng, u=scale, v=scale, a=0.01, n_compute=20, n_load=5):
            fit.observe(s)
        fits.append(fit.measurement())
    assert fits[0] is not None and fits[1] is not None
    assert fits[0].kappa_crit_linear == pytest.approx(fits[1].kappa_crit_linear) == pytest.approx(
        H100.kappa_crit_linear)


@pytest.mark.parametrize(("n", "level"), [(3, 0.75), (6, 1 - 2 / 64), (7, 1 - 2 / 128), (20, None)],
                         ids=["3", "6", "7", "20"])
def test_median_interval_is_distribution_free(n: int, level: float | None) -> None:
    ordered = [float(i) for i in range(n)]
    low, high, got = median_interval(ordered)
    if level is not None:  # only [min, max] reaches that far
        assert (low, high, got) == (0.0, n - 1.0, pytest.approx(level))
    else:  # P(Bin(20, ½) ≤ 4) = 0.0059 ≤ 0.0125 < P(≤ 5) = 0.0207: the 5th to the 16th value
        assert (low, high) == (4.0, 15.0) and got == pytest.approx(1 - 2 * 6196 / 2**20)


def test_theil_sen_matches_sens_published_interval() -> None:
    """On a line with noise, Theil–Sen's slope and Sen's 97.5% interval (the values scipy's
    ``theilslopes(y, x, 0.975)`` gives for these points)."""
    rng = random.Random(1)
    xs = [rng.random() for _ in range(50)]
    ys = [1 + 2 * x + rng.gauss(0, 0.1) for x in xs]
    line = theil_sen(xs, ys)
    assert line is not None
    assert (line.slope, line.slope_low, line.slope_high) == pytest.approx(
        (2.058870883376119, 1.9642392451221, 2.1762588877647793))
    assert theil_sen([1.0, 1.0], [2.0, 3.0]) is None
    assert not math.isnan(line.intercept)
