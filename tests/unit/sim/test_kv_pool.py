"""A KV pool the simulated fleet shares: written on prefill, loaded by another backend, seen by the router."""

from __future__ import annotations

import pytest

from fleet_config.catalog import default_catalog
from router.cost import BackendSpec
from router.policies import build_policy
from sim.fleet import Fleet, SimBackend
from sim.prompts import prepare_trace
from sim.simulator import DecisionEvent, simulate
from sim.traces import TraceRequest

CATALOG = default_catalog()
MODEL = "llama-3.1-8b"
B_KV = 131_072  # Llama-3.1-8B: 2 · 32 layers · 8 KV heads · 128 · 2 bytes per token


def fleet(pool_gb: float | None) -> Fleet:
    link = None if pool_gb is None else 20.0
    spec = BackendSpec(model=CATALOG.model(MODEL), hardware=CATALOG.hw("h100-sxm"), kv_pool_link_gb_s=link)
    return Fleet((SimBackend("a", MODEL, spec), SimBackend("b", MODEL, spec)),
                 kv_pool_bytes=None if pool_gb is None else pool_gb * 1e9)


def run(pool_gb: float | None):
    """The same 20,000-token prompt twice, 10 s apart; round-robin sends the second to the other backend."""
    f = fleet(pool_gb)
    trace = [TraceRequest(arrival_s=0.0, input_tokens=20_000, output_tokens=1, hash_ids=tuple(range(40))),
             TraceRequest(arrival_s=10.0, input_tokens=20_000, output_tokens=1, hash_ids=tuple(range(40)))]
    events: list[DecisionEvent] = []
    result = simulate(f, build_policy("round-robin"), prepare_trace(trace, model=MODEL, block_size_bytes=f.block_size_bytes),
                      observer=events.append)
    return result, events


def test_a_prefix_prefilled_on_one_backend_is_loaded_from_the_pool_on_another() -> None:
    result, events = run(pool_gb=100)
    first, second = result.records
    assert first.backend_id != second.backend_id
    # vLLM hits are whole 16-token blocks, capped at prompt − 1: 1,249 blocks of 20,000 tokens.
    assert (second.cached_tokens, second.cached_kv_pool_tokens, second.cached_host_tokens) == (19_984, 19_984, 0)
    view = next(v for v in events[1].views if v.backend_id == second.backend_id)
    assert view.kv_pool_blocks > 0 and view.hbm_blocks == view.host_blocks == 0  # the router saw it in the pool
    chosen = events[1].decision.chosen
    assert chosen.cached_kv_pool_tokens > 0 and chosen.uncached_prompt_tokens < 1_000
    # Its prefill is the load of 19,984 tokens' KV over the 20 GB/s pool link (and 16 tokens of compute).
    assert second.ttft_s == pytest.approx(19_984 * B_KV / 20e9, rel=0.05)
    assert second.ttft_s < first.ttft_s


def test_without_a_pool_the_other_backend_prefills_it_again() -> None:
    result, events = run(pool_gb=None)
    second = result.records[1]
    assert (second.cached_tokens, second.cached_kv_pool_tokens) == (0, 0)
    assert all(v.kv_pool_blocks == 0 for v in events[1].views)
