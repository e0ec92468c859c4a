"""Measured factors into the spec the router prices with (`router.link_factors`): the blend, by value."""

from __future__ import annotations

import math

import pytest

from fleet_config import default_catalog
from router.cost import BackendSpec
from router.link_factors import (
    PROFILE,
    FactorEstimate,
    LinkFactorEstimates,
    LinkFactors,
    MeasurementSettings,
    blended,
    deviations,
    measured_spec,
    routed_factors,
)
from router.profiles import GB

CATALOG = default_catalog()
H100 = BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("h100-sxm"), tensor_parallel=4,
                   power_cap_w=350, kv_pool_link_gb_s=60)
N0 = MeasurementSettings(prior_requests=2.0, resolution=0.01)


def estimate(ratio: float, evidence: float, *, ci: tuple[float, float] | None = None) -> FactorEstimate:
    low, high = ci or (ratio, ratio)
    return FactorEstimate(ratio, low, high, math.ceil(evidence), evidence)


@pytest.mark.parametrize(
    ("ratio", "evidence", "expected"),
    [
        (4.0, 2.0, 2.0),  # two requests against a prior of two: half way in log, 4^(1/2)
        (4.0, 6.0, 4.0 ** 0.75),  # 6 / (6 + 2) of the way: 2.83, rounded to a 1% step in log
        (0.25, 2.0, 0.5),  # faster than profiled, the same way
        (1.015, 2.0, 1.0),  # half way is 0.75%: within the 1% resolution, the profile stands
        (1.003, 500.0, 1.0),  # the mocks' decodes in a prefill's steps: +0.3%, never routed on
        (1.05, 1e9, 1.05),  # all the evidence in the world: the measured factor (rounded)
    ],
)
def test_blend_by_evidence(ratio: float, evidence: float, expected: float) -> None:
    got = blended(estimate(ratio, evidence), N0)
    step = math.log(1.01)
    assert got == pytest.approx(math.exp(round(math.log(expected) / step) * step), rel=1e-12)


def test_no_evidence_is_the_profile() -> None:
    assert blended(None, N0) == 1.0
    assert routed_factors(None, N0) == PROFILE
    assert routed_factors(LinkFactorEstimates(compute=estimate(1.0, 50)), N0) == PROFILE


def test_one_sample_never_jumps() -> None:
    """One request of evidence moves a factor a third of the way (in log) with n0 = 2."""
    assert blended(estimate(27.0, 1.0), N0) == pytest.approx(3.0, rel=0.01)


def test_measured_spec_divides_each_resource_by_its_factor() -> None:
    spec = measured_spec(H100, LinkFactors(compute=2.0, host_link=4.0, kv_pool_link=0.5, hbm=1.25))
    assert spec.c_eff_flops_per_s == pytest.approx(H100.c_eff_flops_per_s / 2)
    assert spec.link_bytes_per_s == pytest.approx(4 * 15 * GB / 4)  # 4 × 15 GB/s, four times as slow
    assert spec.kv_pool_link_bytes_per_s == pytest.approx(120 * GB)
    assert spec.hbm_bandwidth_bytes_per_s == pytest.approx(H100.hbm_bandwidth_bytes_per_s / 1.25)
    assert spec.kappa_crit_linear == pytest.approx(H100.kappa_crit_linear * 2 / 4)
    assert (spec.model, spec.hardware, spec.power_cap_w, spec.max_power_w) == (
        H100.model, H100.hardware, H100.power_cap_w, H100.max_power_w)  # power is not measured


def test_the_profile_keeps_its_identity_and_alike_backends_share_one_spec() -> None:
    assert measured_spec(H100, PROFILE) is H100
    factors = LinkFactors(host_link=2.0)
    assert measured_spec(H100, factors) is measured_spec(H100, LinkFactors(host_link=2.0))


def test_compute_alone_keeps_the_links_bit_for_bit() -> None:
    spec = measured_spec(H100, LinkFactors(compute=1.5))
    assert spec.link_bytes_per_s == H100.link_bytes_per_s and spec.kv_pool_link_gb_s == H100.kv_pool_link_gb_s


@pytest.mark.parametrize(
    ("factor", "told"),
    [
        (estimate(4.0, 5, ci=(3.0, 5.0)), True),  # four times as slow, surely
        (estimate(0.2, 5, ci=(0.15, 0.3)), True),  # five times as fast
        (estimate(2.0, 2, ci=(1.2, 3.5)), False),  # its interval reaches within 1.5×: not told yet
        (estimate(1.3, 50, ci=(1.28, 1.32)), False),  # off, but within the ratio
    ],
)
def test_deviations_beyond_the_ratio_with_their_whole_interval(factor: FactorEstimate, told: bool) -> None:
    found = deviations(LinkFactorEstimates(compute=estimate(1.0, 40), host_link=factor), 1.5)
    assert found == ({"host_link": factor.time_ratio} if told else {})


def test_a_factor_whose_interval_holds_one_is_the_profile() -> None:
    """The profile right, a compute factor read 1.18 [0.94, 1.48] from 18 requests in the simulator
    before it settled at 1.000: not contradicted, not routed on."""
    assert blended(estimate(1.18, 18, ci=(0.94, 1.48)), N0) == 1.0
    assert blended(estimate(1.18, 18, ci=(1.05, 1.33)), N0) == pytest.approx(1.18 ** (18 / 20), rel=0.01)


def test_compute_moves_only_on_enough_evidence() -> None:
    """Live, its config right, a GH200 read compute 1.49 [1.05, 2.10] from 9 requests: compute needs 16."""
    few = LinkFactorEstimates(compute=estimate(1.49, 9, ci=(1.05, 2.1)))
    many = LinkFactorEstimates(compute=estimate(1.49, 20, ci=(1.3, 1.7)))
    assert routed_factors(few, N0) == PROFILE
    assert routed_factors(many, N0).compute == pytest.approx(1.49 ** (20 / 22), rel=0.01)
