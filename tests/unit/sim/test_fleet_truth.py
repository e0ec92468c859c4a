"""``kappa-gateway sim --fleet-truth`` (issue 29): the engines run the truth fleet, the router the configured
one, and measures the difference from what it sees live (scraped metrics, its own timings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_config import default_catalog, load_settings
from gateway.commands.sim_command import load_requests
from gateway.commands.sim_truth import run_truth_sim, truth_fleets
from router import kappa

CONFIG = Path(__file__).resolve().parents[3] / "config" / "fleets"
CATALOG = default_catalog()


def c_eff(hardware: str, tensor_parallel: int, cap_w: float | None) -> float:
    return kappa.c_eff_flops_per_s(CATALOG.hw(hardware), power_cap_w=cap_w, tensor_parallel=tensor_parallel)


def test_the_engines_run_the_truth_and_the_router_the_config() -> None:
    configured = load_settings(CONFIG / "heterogeneous.yaml", CATALOG, env={})
    fleets = truth_fleets(configured, load_settings(CONFIG / "heterogeneous.truth.yaml", CATALOG, env={}))
    lied_to = {b.id: b for b in fleets["corrected"].backends}
    assert lied_to["gh200"].spec.link_bytes_per_s == 4 * 300e9  # the profile's NVLink-C2C, as configured
    assert lied_to["gh200"].engine_spec.link_bytes_per_s == 120e9  # what the engine really has
    assert lied_to["b200-b"].engine_spec == lied_to["b200-b"].spec  # the control
    assert not fleets["uncorrected"].measurement.enabled and fleets["corrected"].measurement.enabled
    assert {b.id: b.spec for b in fleets["truth"].backends} == {b.id: b.engine_spec for b in lied_to.values()}


def test_measurement_finds_what_the_config_got_wrong() -> None:
    """200 agentic-coding requests on the heterogeneous fleet with a KV pool: the corrected run measures
    the power caps' compute and the slow pool links of b200-a and the GH200 within 1%, and b200-b (its
    config true) at 1; the other two runs measure nothing."""
    report = run_truth_sim(load_requests(None, "agentic-coding", 200, 0), CONFIG / "heterogeneous.yaml",
                           CONFIG / "heterogeneous.truth.yaml", ["kappa"], rate_scale=1.0, seed=0, kv_pool_gb=1000)
    truth = report["true_factors"]
    assert truth["b200-a"]["compute"] == pytest.approx(c_eff("b200", 2, None) / c_eff("b200", 2, 700))
    assert (truth["b200-a"]["host_link"], truth["b200-a"]["kv_pool_link"]) == pytest.approx((30 / 12, 30 / 12))
    assert (truth["gh200"]["host_link"], truth["gh200"]["kv_pool_link"]) == pytest.approx((1200 / 120, 100 / 40))
    assert (truth["h100-capped"]["host_link"], truth["h100-capped"]["kv_pool_link"]) == pytest.approx((3.0, 1.0))
    measured = report["measured"]["kappa"]
    for backend, factor in [("b200-a", "compute"), ("b200-a", "kv_pool_link"), ("gh200", "kv_pool_link"),
                            ("h100-capped", "compute")]:
        assert measured[backend]["factors"][factor]["time_ratio"] == pytest.approx(truth[backend][factor], rel=0.01)
    assert all(f is None or f["time_ratio"] == pytest.approx(1.0, rel=0.01)
               for f in measured["b200-b"]["factors"].values())
    assert 1.0 < measured["b200-a"]["routed"]["kv_pool_link"] < 2.5  # blended with the profile, not jumped
    assert set(report["policies"]["kappa"]) == {"uncorrected", "corrected", "truth"}


def test_a_truth_fleet_of_other_backends_is_refused() -> None:
    import dataclasses

    from sim.fleet import fleet_from_settings, fleet_with_truth

    fleet = fleet_from_settings(load_settings(CONFIG / "heterogeneous.yaml", CATALOG, env={}), CATALOG)
    fewer = dataclasses.replace(fleet, backends=fleet.backends[:2])
    with pytest.raises(ValueError, match="not the configured fleet's"):
        fleet_with_truth(fleet, fewer)
