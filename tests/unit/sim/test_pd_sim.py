"""P/D in the simulator: a split's timing worked out from its parts, links that must not be used, the report."""

from __future__ import annotations

import pytest

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from mock_vllm.engine import MockEngine
from router import kappa
from router.cost import BackendSpec
from router.links import Interconnect, Link
from router.policies import build_policy
from sim.fleet import Fleet, SimBackend, fleet_from_settings
from sim.prompts import prepare_trace, token_ids
from sim.report import policy_report
from sim.simulator import simulate
from sim.traces import TraceRequest

CATALOG = default_catalog()
MODEL = "llama-3.1-8b"
H100_8B = BackendSpec(model=CATALOG.model(MODEL), hardware=CATALOG.hw("h100-sxm"))
LINK = Link.of(10, 0.01, "rdma")  # 10 GB/s, 10 ms per transfer


def pd_fleet(interconnect: Interconnect = Interconnect(default=LINK), **kw: object) -> Fleet:
    backends = (SimBackend("p", MODEL, H100_8B, kv_role="prefill"), SimBackend("d", MODEL, H100_8B, kv_role="decode"))
    return Fleet(backends, interconnect=interconnect, **kw)  # type: ignore[arg-type]


def trace(fleet: Fleet, prompt: int = 4_096, max_tokens: int = 4, n: int = 1):
    reqs = [TraceRequest(i * 100.0, prompt, max_tokens, tuple(range(1000 * i, 1000 * i + 8))) for i in range(n)]
    return prepare_trace(reqs, model=MODEL, block_size_bytes=fleet.block_size_bytes)


def test_a_split_request_pays_prefill_then_transfer_then_the_decode_step() -> None:
    fleet = pd_fleet()
    requests = trace(fleet)
    result = simulate(fleet, build_policy("pd-always", {"picker": "round-robin"}), requests)
    (record,) = result.records
    assert record.prefill_backend_id == "p" and record.backend_id == "d"
    # by hand: the prompt alone on p (max_tokens 1), its whole KV over the link, d's first step
    tokens = token_ids(requests[0])
    alone = MockEngine(H100_8B)
    alone.add_request("x", tokens, max_tokens=1, arrival_s=0.0)
    prefill_s = alone.step(0.0).end_s
    transfer_s = 0.01 + kappa.kv_bytes(H100_8B.model, 4_096) / 10e9
    decoder = MockEngine(H100_8B)
    decoder.add_request("y", tokens, max_tokens=4, arrival_s=0.0, remote_from_block=0)
    first_step_s = decoder.step(0.0).duration_s
    assert record.transfer_tokens == 4_096 and record.transfer_s == pytest.approx(transfer_s)
    assert record.prefill_done_s == pytest.approx(prefill_s)
    assert record.ttft_s >= prefill_s + transfer_s
    assert record.ttft_s == pytest.approx(prefill_s + transfer_s + first_step_s)
    assert record.cached_tokens == 0 and record.prompt_tokens == 4_096  # the prefill's figures


def test_a_link_delivering_less_than_configured_slows_the_pull_not_the_decision() -> None:
    slow = Link.of(1, 0.01, "rdma")
    fast, lying = pd_fleet(), pd_fleet(delivered_links={("p", "d"): slow})
    fast_rec = simulate(fast, build_policy("pd-always"), trace(fast)).records[0]
    lying_rec = simulate(lying, build_policy("pd-always"), trace(lying)).records[0]
    assert lying_rec.prefill_backend_id == "p"  # the router still believes 10 GB/s
    assert lying_rec.transfer_s == pytest.approx(0.01 + kappa.kv_bytes(H100_8B.model, 4_096) / 1e9)
    assert lying_rec.ttft_s - fast_rec.ttft_s == pytest.approx(lying_rec.transfer_s - fast_rec.transfer_s)


@pytest.mark.parametrize("policy", ["kappa", "pd-always", "pd-llmd", "pd-dynamo"])
@pytest.mark.parametrize("links", ["none", "unusable"])
def test_without_a_usable_link_nothing_splits(policy: str, links: str) -> None:
    fleet = (pd_fleet(Interconnect()) if links == "none"
             else pd_fleet(unusable_links=frozenset({("p", "d")})))
    result = simulate(fleet, build_policy(policy), trace(fleet, prompt=8_192, n=3))
    assert all(r.prefill_backend_id is None and r.backend_id == "d" for r in result.records)
    assert policy_report(result)["disaggregated_share"] == 0


def test_the_report_gives_the_share_split_and_the_disaggregated_fleet_runs() -> None:
    settings = load_settings(CONFIG_DIR / "fleets" / "disaggregated.yaml", CATALOG, env={})
    fleet = fleet_from_settings(settings, CATALOG)
    assert fleet.pd_fleet() is not None and fleet.delivered_link("b200-p0", "h100-d0") is not None
    reqs = [TraceRequest(i * 0.5, 3_000 + 500 * (i % 4), 8, tuple(range(100 * i, 100 * i + 6))) for i in range(12)]
    prepared = prepare_trace(reqs, model=fleet.served_models()[0], block_size_bytes=fleet.block_size_bytes)
    report = policy_report(simulate(fleet, build_policy("pd-always"), prepared))
    assert report["disaggregated_share"] == 1.0 and report["finished"] == 12
    assert report["transfer_s_p50"] > 0
    assert sum(b["prefill_requests"] for b in report["backends"]) == 12
    aggregated = policy_report(simulate(fleet, build_policy("kappa-aggregated"), prepared))
    assert aggregated["disaggregated_share"] == 0 and aggregated["finished"] == 12
