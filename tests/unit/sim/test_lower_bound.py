"""The TTFT lower bound: a hand-worked case, no simulated request beating it, the ratios in the sim JSON."""

from __future__ import annotations

import pytest

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from gateway.commands.sim_command import run_sim
from router.cost import BackendSpec, RequestShape, predict
from sim.fleet import Fleet, SimBackend, fleet_from_settings
from sim.lower_bound import lower_bound_ratios, lower_bound_summary, lower_bound_ttfts
from sim.report import policy_report
from sim.runner import run_policies
from sim.traces import TraceRequest
from sim.workloads import build_workload, mooncake_like

CATALOG = default_catalog()
MODEL = "llama-3.1-8b"
H100 = BackendSpec(model=CATALOG.model(MODEL), hardware=CATALOG.hw("h100-sxm"))
B200 = BackendSpec(model=CATALOG.model(MODEL), hardware=CATALOG.hw("b200"))


def heterogeneous() -> Fleet:
    settings = load_settings(CONFIG_DIR / "fleets" / "heterogeneous.yaml", CATALOG, env={})
    return fleet_from_settings(settings, CATALOG)


def test_bound_is_the_best_backends_empty_prefill_with_the_shared_prefix_in_hbm() -> None:
    backends = [SimBackend("h100", MODEL, H100), SimBackend("b200", MODEL, B200)]
    trace = [TraceRequest(0.0, 4_096, 50, tuple(range(8))),
             TraceRequest(9.0, 3_000, 50, (0, 1, 2, 3, 100, 101)),  # shares 4 blocks = 2,048 tokens
             TraceRequest(9.5, 1_024, 5, (0, 1))]  # all of it seen before: K = P − 1
    bounds = lower_bound_ttfts(trace, backends)

    def best(cached: int, new: int) -> float:
        shape = RequestShape(cached_hbm_tokens=cached, cached_host_tokens=0, uncached_prompt_tokens=new, output_tokens=1)
        return min(predict(shape, H100).ttft_s, predict(shape, B200).ttft_s)

    assert bounds == [best(0, 4_096), best(2_048, 952), best(1_023, 1)]
    assert bounds[0] == predict(RequestShape(0, 0, 4_096, 1), B200).ttft_s  # the B200 computes faster
    assert bounds[2] < bounds[1] < bounds[0]
    summary = lower_bound_summary(bounds)
    assert summary["ttft_p50_s"] == bounds[1] and summary["ttft_mean_s"] == pytest.approx(sum(bounds) / 3)
    with pytest.raises(ValueError):
        lower_bound_ttfts(trace, [])


def test_no_policy_beats_the_bound_and_the_ratios_follow() -> None:
    fleet = heterogeneous()
    trace = mooncake_like(200, rate_rps=3.4, seed=4)
    bounds = lower_bound_ttfts(trace, fleet.backends)
    results = run_policies(trace, fleet, ["kappa", "round-robin", "prefix-affinity"], workers=1)
    for name, result in results.items():
        for record in result.records:
            assert record.ttft_s >= bounds[record.index] * (1 - 1e-9), (name, record.index)
        ratios = lower_bound_ratios(result, bounds)
        report = policy_report(result)
        assert ratios["ttft_mean_lower_bound_ratio"] >= 1
        assert ratios["ttft_p50_lower_bound_ratio"] == pytest.approx(report["ttft_p50_s"] / lower_bound_summary(
            [bounds[r.index] for r in result.records])["ttft_p50_s"])


def test_the_simulated_hit_rate_collapses_under_a_sliding_window() -> None:
    fleet = heterogeneous()
    hits = {}
    for name in ("chat", "chat-sliding-window"):
        result = run_policies(build_workload(name, 300, seed=1), fleet, ["prefix-affinity"], workers=1)
        hits[name] = policy_report(result["prefix-affinity"])["prefix_hit_ratio"]
    # 300 requests (~90 s) are mostly early turns; the benchmark's longer runs show a deeper drop.
    assert hits["chat"] > 0.5
    assert hits["chat-sliding-window"] < 0.8 * hits["chat"]


def test_sim_json_carries_the_bound_and_every_policys_ratios() -> None:
    report = run_sim(None, "document-qa", CONFIG_DIR / "fleets" / "homogeneous.yaml", ["kappa", "round-robin"],
                     limit=20, rate_scale=1.0, seed=0, workers=1)
    bound = report["run"]["lower_bound"]
    assert set(bound) == {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s"}
    assert 0 < bound["ttft_p50_s"] <= bound["ttft_p90_s"]
    for policy in report["policies"].values():
        assert policy["ttft_p50_lower_bound_ratio"] >= 1
        assert policy["ttft_p90_lower_bound_ratio"] > 0
        assert policy["ttft_mean_lower_bound_ratio"] >= 1
