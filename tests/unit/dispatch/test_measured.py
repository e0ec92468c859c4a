"""A target's measured figures (`dispatch.measured`): the routed spec moves on scrapes, by the blend, and
a restart puts it back on the profile."""

from __future__ import annotations

import random

import pytest

from dispatch import BackendMetrics, Target
from fleet_config import default_catalog
from router.cost import BackendSpec
from tests.unit.dispatch.feed_support import candidate, step, usage
from router.link_factors import LinkFactors, MeasurementSettings, measured_spec

CATALOG = default_catalog()
H100 = BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4,
                   power_cap_w=350)


def run(target: Target, v_host: float, n: int, seed: int) -> list[bool]:
    """``n`` scrape intervals of one compute-bound request and one host-tier follow-up each, one after the
    other, the host link ``v_host``× as slow as profiled: what the engine's histogram would read."""
    rng = random.Random(seed)
    count, total = 0, 0.0
    target.measure(BackendMetrics(prefill_time_count=0, prefill_time_sum_s=0.0), 0.0)  # the baseline
    changed = []
    feed = target.figures.feed
    for k in range(n):
        t = 10.0 * k + 1.0
        new = rng.randint(2_000, 8_000)
        host, extra = rng.randint(20_000, 40_000) // 16 * 16, rng.randint(20, 100)
        cold, follow = step([(new, 0)], spec=H100), step([(extra, host)], host_tokens=host, spec=H100)
        for prompt, cached, term, at_s in ((new, 0, cold, t), (host + extra, host, follow, t + 5.0)):
            sequence = feed.sent(at_s, candidate(prompt, host=cached, spec=H100))
            seconds = max(term.t_compute_s, v_host * term.t_load_s, term.t_hbm_s)
            feed.first_token(sequence, at_s + seconds)
            feed.completed_request(sequence, usage(prompt, cached), at_s + seconds + 0.1)
            count, total = count + 1, total + seconds
        changed.append(target.measure(BackendMetrics(prefill_time_count=count, prefill_time_sum_s=total), t + 9.0))
    return changed


def test_the_spec_follows_the_blend_and_a_restart_resets_it() -> None:
    target = Target("h100", H100)
    changed = run(target, 4.0, 12, seed=1)
    # 12 host-link requests, 10 s apart, aged with τ = 600 s: evidence Σ e^(−10 j / 600) = 10.967; against a
    # prior of 2 that is 10.967/12.967 of the way in log: 4^0.8458 = 3.2300, rounded to a 1% step: 1.01^118
    assert target.figures.factors.compute == 1.0
    assert target.figures.factors.host_link == pytest.approx(1.01 ** 118, rel=1e-9)
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
