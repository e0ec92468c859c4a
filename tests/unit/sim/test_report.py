"""The per-policy report on a hand-made run: percentiles, rates, energy, hits, regimes, per backend."""

from __future__ import annotations

import pytest

from fleet_config.catalog import default_catalog
from router.cost import BackendSpec
from sim.fleet import SimBackend
from sim.report import percentile, policy_report
from sim.simulator import RequestRecord, SimResult

CATALOG = default_catalog()
DENSE = SimBackend("dense", "m", BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("b200"),
                                             tensor_parallel=2), labels={"role": "compute-dense"})
FAST_LINK = SimBackend("link", "m", BackendSpec(model=CATALOG.model("llama-3.1-70b"), hardware=CATALOG.hw("gh200"),
                                                tensor_parallel=2))


def record(i: int, backend: str, ttft: float, e2e: float, prompt: int, cached: int, kappa_ratio: float,
           regime: str = "compute") -> RequestRecord:
    r = RequestRecord(i, float(i), backend, 10, kappa_ratio, kappa_ratio / 2, 6.4, regime, ttft)
    r.first_token_s, r.finish_s = i + ttft, i + e2e
    r.prompt_tokens, r.cached_tokens, r.cached_host_tokens = prompt, cached, cached // 2
    return r


def test_report_on_a_hand_made_run() -> None:
    records = [record(0, "dense", 1.0, 2.0, 1000, 0, 0.0),
               record(1, "dense", 3.0, 4.0, 1000, 500, 1.0),
               record(2, "link", 9.0, 10.0, 2000, 1900, 19.0, "transfer"),
               record(3, "link", 2.0, 6.0, 4000, 0, 0.0)]
    result = SimResult("kappa", records, [], 0.0, 12.0, {"dense": 100.0, "link": 300.0}, (DENSE, FAST_LINK), 0.1)
    report = policy_report(result, ttft_slo_s=2.5)
    assert report["ttft_p50_s"] == pytest.approx(2.5)  # 1, 2, 3, 9 -> midway between 2 and 3
    assert report["ttft_p90_s"] == pytest.approx(3 + 0.7 * 6)
    assert report["e2e_p50_s"] == pytest.approx(5.0)
    assert report["e2e_p90_s"] == pytest.approx(6 + 0.7 * 4)  # 2, 4, 6, 10
    # ITL: (E2E − TTFT) / (max_tokens − 1) per request = 1/9, 1/9, 1/9, 4/9
    assert report["itl_p50_s"] == pytest.approx(1 / 9)
    assert report["itl_p90_s"] == pytest.approx((1 + 0.7 * 3) / 9)
    assert report["throughput_rps"] == pytest.approx(4 / 12)
    assert report["goodput_rps"] == pytest.approx(2 / 12)
    assert report["energy_per_request_j"] == pytest.approx(100.0)
    assert report["prefix_hit_ratio"] == pytest.approx(2400 / 8000)
    assert report["host_hit_ratio"] == pytest.approx(1200 / 8000)
    assert report["regime_share"] == {"compute": 0.75, "transfer": 0.25}
    dense, link = report["backends"]
    assert report["high_kappa_threshold"] == pytest.approx(DENSE.spec.kappa_crit_linear)
    assert (dense["requests"], link["requests"]) == (2, 2)
    # each backend's transfer share is its own regime count (record 2 on link), not a κ threshold
    assert (dense["transfer_share"], link["transfer_share"]) == (0.0, 0.5)
    assert dense["kappa_crit_linear"] == pytest.approx(DENSE.spec.kappa_crit_linear) and "kappa_crit" not in dense
    # only κ_ratio 19 > 6.4: half of link's requests, all of the run's high-κ ones
    assert (dense["high_kappa_share"], link["high_kappa_share"]) == (0.0, 0.5)
    assert (dense["high_kappa_of_all"], link["high_kappa_of_all"]) == (0.0, 1.0)
    # new tokens 1000, 500, 100, 4000: p90 = 1000 + 0.7·3000 = 3100, so only record 3 is large-T
    assert report["large_t_threshold_tokens"] == pytest.approx(3100)
    assert (dense["large_t_share"], link["large_t_share"]) == (0.0, 0.5)
    assert (dense["large_t_of_all"], link["large_t_of_all"]) == (0.0, 1.0)
    assert dense["prefix_hit_ratio"] == pytest.approx(0.25)


def test_percentile_is_linear_and_empty_is_none() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
