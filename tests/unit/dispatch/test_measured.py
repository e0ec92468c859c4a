"""A target's measured figures (`dispatch.measured`): the routed spec moves on scrapes, by the blend, and
a restart puts it back on the profile."""

from __future__ import annotations

import random

import pytest

from dispatch import BackendMetrics, Target
from fleet_config import default_catalog
from router.cost import BackendSpec
from router.kappa_fit import PrefillPrediction
from router.link_factors import LinkFactors, MeasurementSettings, measured_spec

CATALOG = default_catalog()
H100 = BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4,
                   power_cap_w=350)


def feed_interval(target: Target, requests: list[PrefillPrediction], seconds: float, now_s: float,
                  state: dict[str, float]) -> bool:
    """Complete ``requests`` there, then scrape a histogram grown by them and ``seconds``."""
    for r in requests:
        target.figures.feed.completed_request(r)
    state["count"] += len(requests)
    state["sum"] += seconds
    return target.measure(BackendMetrics(prefill_time_count=state["count"], prefill_time_sum_s=state["sum"]), now_s)


def run(target: Target, v_host: float, n: int, seed: int) -> list[bool]:
    """``n`` intervals of one compute-bound request and one host-tier follow-up each, the link ``v_host``× slow."""
    rng = random.Random(seed)
    state = {"count": 0.0, "sum": 0.0}
    target.measure(BackendMetrics(prefill_time_count=0, prefill_time_sum_s=0.0), 0.0)  # the baseline
    changed = []
    for k in range(n):
        cold = PrefillPrediction.of(H100, cached_hbm_tokens=0, cached_host_tokens=0, cached_kv_pool_tokens=0,
                                    uncached_prompt_tokens=rng.randint(2_000, 8_000))
        load = PrefillPrediction.of(H100, cached_hbm_tokens=0, cached_host_tokens=rng.randint(20_000, 40_000),
                                    cached_kv_pool_tokens=0, uncached_prompt_tokens=rng.randint(20, 100))
        seconds = cold.t_compute_s + max(load.t_compute_s, v_host * load.t_load_s)
        changed.append(feed_interval(target, [cold, load], seconds, float(k + 1), state))
    return changed


def test_the_spec_follows_the_blend_and_a_restart_resets_it() -> None:
    target = Target("h100", H100)
    changed = run(target, 4.0, 12, seed=1)
    # 12 host-link requests against a prior of 2: 12/14 of the way in log: 4^(6/7) ≈ 3.28
    assert target.figures.factors.compute == 1.0 and target.figures.factors.host_link == pytest.approx(
        4.0 ** (12 / 14), rel=0.01)
    assert target.spec is measured_spec(H100, target.figures.factors) and target.profile_spec is H100
    assert target.spec.link_bytes_per_s == pytest.approx(H100.link_bytes_per_s / target.figures.factors.host_link)
    assert changed[:7] == [False] * 7 and any(changed[7:])  # measured from 8 compute-bound requests on
    assert target.figures.deviations() == {"host_link": pytest.approx(4.0)}
    assert target.figures.new_deviations() == {"host_link": pytest.approx(4.0)}
    assert target.figures.new_deviations() == {}  # told once
    target.restarted()
    assert target.spec is H100 and target.figures.factors == LinkFactors() and target.figures.fit.intervals == 0


def test_disabled_measurement_keeps_the_profile() -> None:
    target = Target("h100", H100, measurement=MeasurementSettings(enabled=False))
    assert not any(run(target, 4.0, 12, seed=1))
    assert target.spec is H100
    m = target.figures.measurement()  # still measured and reported
    assert m is not None and m.factors.host_link is not None and m.factors.host_link.time_ratio == pytest.approx(4.0)


def test_a_right_profile_moves_nothing() -> None:
    target = Target("h100", H100)
    assert not any(run(target, 1.0, 20, seed=2))
    assert target.spec is H100
