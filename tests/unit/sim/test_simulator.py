"""The simulator: physics worked out by hand, lagged views, determinism, a Mooncake-like run."""

from __future__ import annotations

import pytest

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from router.cost import BackendSpec
from router.policies import POLICY_NAMES, build_policy
from sim.fleet import Fleet, SimBackend, fleet_from_settings
from sim.prompts import prepare_trace
from sim.report import policy_report
from sim.runner import run_policies
from sim.simulator import DecisionEvent, simulate
from sim.traces import TraceRequest
from sim.workloads import mooncake_like

CATALOG = default_catalog()
MODEL = "llama-3.1-8b"
H100_8B = BackendSpec(model=CATALOG.model(MODEL), hardware=CATALOG.hw("h100-sxm"))


def one_backend_fleet(scrape_interval_s: float = 1.0) -> Fleet:
    return Fleet((SimBackend("h100", MODEL, H100_8B),), scrape_interval_s=scrape_interval_s)


def prepared(requests: list[TraceRequest], fleet: Fleet):
    return prepare_trace(requests, model=fleet.served_models()[0], block_size_bytes=fleet.block_size_bytes)


def heterogeneous() -> Fleet:
    settings = load_settings(CONFIG_DIR / "fleets" / "heterogeneous.yaml", CATALOG, env={})
    return fleet_from_settings(settings, CATALOG)


def test_two_requests_on_one_backend_match_the_hand_worked_roofline() -> None:
    """A: 10,000 tokens at t=0, 2 output tokens; B: 7,000 tokens at t=0.05, 1 output token; no hits.

    Llama-3.1-8B on one H100 SXM: N = 8.03e9 active parameters, attention coefficient
    a = 4·L·n_q·d = 4·32·32·128 = 524,288 FLOPs per (new × attended) token, C_eff = 989e12 ×
    0.45 = 445.05e12 FLOP/s. A prefill of T tokens after K costs T·2N + a·T·(K + T/2) FLOPs.
    The engine's token budget is 8,192 per step (chunked prefill), running requests first:

    step 1 at 0:      A's first chunk, 8,192 tokens (B has not arrived; it waits for step 2)
    step 2 at d1:     A's last 1,808 tokens after 8,192; B's first 6,384 (the budget left)
                      -> A's first token at d1 + d2
    step 3 at d1+d2:  A decodes 1 token after 10,000; B's last 616 tokens after 6,384
                      -> B's first (and only) token and A's second at d1 + d2 + d3

    Every step is compute-bound here (weights read 16 GB / 3.35 TB/s = 4.8 ms is shorter).
    """
    n2, a, c_eff = 2 * 8.03e9, 4 * 32 * 32 * 128, 989e12 * 0.45

    def flops(cached: float, new: float) -> float:
        return new * n2 + a * new * (cached + new / 2)

    d1 = flops(0, 8192) / c_eff
    d2 = (flops(8192, 1808) + flops(0, 6384)) / c_eff
    d3 = (flops(10_000, 1) + flops(6384, 616)) / c_eff
    assert d3 > (16.06e9 + 2 * 131_072 * 10_000) / 3.35e12  # step 3, the shortest, is still compute-bound

    fleet = one_backend_fleet()
    trace = [TraceRequest(arrival_s=0.0, input_tokens=10_000, output_tokens=2),
             TraceRequest(arrival_s=0.05, input_tokens=7_000, output_tokens=1)]
    result = simulate(fleet, build_policy("kappa"), prepared(trace, fleet))
    a_rec, b_rec = result.records
    assert a_rec.ttft_s == pytest.approx(d1 + d2, rel=1e-6)
    assert a_rec.e2e_s == pytest.approx(d1 + d2 + d3, rel=1e-6)
    assert b_rec.ttft_s == pytest.approx(d1 + d2 + d3 - 0.05, rel=1e-6)
    assert b_rec.e2e_s == b_rec.ttft_s
    assert (a_rec.prompt_tokens, a_rec.cached_tokens, b_rec.prompt_tokens, b_rec.cached_tokens) == (10_000, 0, 7_000, 0)
    assert result.end_s == pytest.approx(d1 + d2 + d3, rel=1e-6)
    assert sum(result.energy_j.values()) > H100_8B.idle_power_w * result.end_s


def burst_views(scrape_interval_s: float) -> list[DecisionEvent]:
    """Five 8,000-token requests 1 ms apart on one backend (its first step alone takes ~0.3 s)."""
    fleet = one_backend_fleet(scrape_interval_s)
    trace = [TraceRequest(arrival_s=i * 0.001, input_tokens=8_000, output_tokens=4) for i in range(5)]
    events: list[DecisionEvent] = []
    simulate(fleet, build_policy("least-loaded"), prepared(trace, fleet), observer=events.append)
    return events


def test_policies_see_the_scraped_snapshot_not_the_engines_live_queue() -> None:
    # Scraped once, at the first arrival, before anything was queued; next scrape in 100 s.
    events = burst_views(scrape_interval_s=100.0)
    assert [e.views[0].in_flight for e in events] == [0, 1, 2, 3, 4]  # the gateway's own ledger: current
    assert [e.views[0].num_requests_waiting for e in events] == [0] * 5  # scraped: stale
    assert [e.views[0].num_requests_running for e in events] == [0] * 5
    assert [e.views[0].kv_cache_usage_ratio for e in events] == [0.0] * 5
    assert events[4].views[0].outstanding_prefill_s == pytest.approx(
        sum(e.decision.chosen.estimate.prefill_s for e in events[:4]))
    assert events[4].views[0].kv_demand_bytes == pytest.approx(
        sum(e.decision.chosen.estimate.kv_demand_bytes for e in events[:4]))


def test_scrapes_refresh_the_snapshot_only_at_scrape_times() -> None:
    # Scrapes at 0, 2.5 ms, 5 ms. At 2.5 ms the engine runs request 0 and queues 1 and 2; the
    # request arriving at 4 ms sees that (waiting 2), not the live queue (1, 2 and 3 waiting).
    events = burst_views(scrape_interval_s=0.0025)
    assert [e.now_s for e in events] == pytest.approx([0.0, 0.001, 0.002, 0.003, 0.004])
    assert [e.views[0].num_requests_waiting for e in events] == [0, 0, 0, 2, 2]
    assert [e.views[0].num_requests_running for e in events] == [0, 0, 0, 1, 1]
    assert [e.views[0].in_flight for e in events] == [0, 1, 2, 3, 4]


def outcome(result) -> list[tuple]:
    return [(r.index, r.backend_id, r.first_token_s, r.finish_s, r.cached_tokens, r.kappa_ratio)
            for r in result.records]


@pytest.fixture(scope="module")
def small_workload() -> list[TraceRequest]:
    return mooncake_like(150, rate_rps=3.4, seed=7)


def test_runs_are_deterministic_for_a_seed(small_workload) -> None:
    fleet = heterogeneous()
    once = run_policies(small_workload, fleet, ["kappa", "weighted"], seed=3, workers=1)
    again = run_policies(small_workload, fleet, ["kappa", "weighted"], seed=3, workers=1)
    for name in once:
        assert outcome(once[name]) == outcome(again[name])
        assert once[name].energy_j == again[name].energy_j


def test_a_mooncake_like_run_finishes_every_request_for_every_policy(small_workload) -> None:
    results = run_policies(small_workload, heterogeneous(), list(POLICY_NAMES), seed=0, workers=1)
    assert list(results) == list(POLICY_NAMES)
    for name, result in results.items():
        assert not result.rejected
        assert [r.index for r in result.records] == list(range(len(small_workload)))
        assert all(r.first_token_s is not None and r.finish_s is not None for r in result.records)
        assert all(r.arrival_s < r.first_token_s <= r.finish_s for r in result.records)
        report = policy_report(result)
        assert report["finished"] == len(small_workload), name
        assert 0 <= report["host_hit_ratio"] <= report["prefix_hit_ratio"] <= 1
        assert all(b["prefix_hit_ratio"] is None or 0 <= b["prefix_hit_ratio"] <= 1 for b in report["backends"])
        assert report["regime_share"]["compute"] + report["regime_share"]["transfer"] == pytest.approx(1)
        assert report["ttft_p50_s"] <= report["ttft_p90_s"] <= report["ttft_p99_s"]
        assert sum(b["requests"] for b in report["backends"]) == len(small_workload)
    # A prefix-aware policy finds more of the conversations' prefixes than one that ignores them.
    hit = {name: policy_report(r)["prefix_hit_ratio"] for name, r in results.items()}
    assert hit["prefix-affinity"] > hit["round-robin"]


def test_forked_workers_give_the_same_results(small_workload) -> None:
    fleet = heterogeneous()
    serial = run_policies(small_workload[:60], fleet, ["kappa", "round-robin"], workers=1)
    forked = run_policies(small_workload[:60], fleet, ["kappa", "round-robin"], workers=2)
    for name in serial:
        assert outcome(serial[name]) == outcome(forked[name])


def test_a_prompt_longer_than_the_context_is_refused_not_simulated() -> None:
    fleet = one_backend_fleet()
    trace = [TraceRequest(arrival_s=0.0, input_tokens=131_000, output_tokens=200),
             TraceRequest(arrival_s=0.1, input_tokens=100, output_tokens=1)]
    result = simulate(fleet, build_policy("kappa"), prepared(trace, fleet))
    assert result.rejected == [0]
    assert [r.index for r in result.records] == [1]


def test_the_shipped_fleets_build() -> None:
    for path in sorted((CONFIG_DIR / "fleets").glob("*.yaml")):
        settings = load_settings(path, CATALOG, env={})
        fleet = fleet_from_settings(settings, CATALOG)
        assert [b.id for b in fleet.backends] == [b.id for b in settings.backends]
        for sim_backend, entry in zip(fleet.backends, settings.backends, strict=True):
            assert sim_backend.spec == settings.backend_spec(CATALOG, entry)
            assert sim_backend.host_tier_bytes == entry.host_tier_gb * 1e9


def test_a_client_concurrency_cap_holds_arrivals_until_a_request_ends() -> None:
    """Ten requests at t = 0 with at most three in flight (`replay --concurrency 3`): never more than
    three run at once, and each later one is sent the moment an earlier one finishes (its record's
    arrival is that send, as the replay client measures from it). A cap of zero is refused."""
    fleet = one_backend_fleet()
    requests = [TraceRequest(0.0, 2_000 + 100 * i, 20 + i, []) for i in range(10)]
    result = simulate(fleet, build_policy("round-robin", {}), prepared(requests, fleet), client_concurrency=3)
    records = result.records
    assert all(r.finish_s is not None for r in records)
    for r in records:
        overlapping = [x for x in records if x.arrival_s <= r.arrival_s < x.finish_s]
        assert len(overlapping) <= 3
    finishes = sorted(r.finish_s for r in records)
    sends = sorted(r.arrival_s for r in records)
    assert sends[:3] == [0.0, 0.0, 0.0]
    assert sends[3:] == pytest.approx(finishes[:7])
    uncapped = simulate(fleet, build_policy("round-robin", {}), prepared(requests, fleet))
    assert [r.arrival_s for r in uncapped.records] == [0.0] * 10
    with pytest.raises(ValueError, match="client_concurrency"):
        simulate(fleet, build_policy("round-robin", {}), prepared(requests, fleet), client_concurrency=0)
