"""The fleet-shared KV pool: its LRU, two caches sharing it, and engines loading over its link."""

from __future__ import annotations

import random

import pytest

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.kv_cache import PagedKVCache, SharedKVPool
from router.cost import BackendSpec

CATALOG = default_catalog()
MODEL = CATALOG.model("llama-3.1-8b")
POOL_LINK_GB_S = 25.0


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 100_000) for _ in range(n)]


def drain(engine: MockEngine, now_s: float = 0.0) -> float:
    while engine.has_unfinished():
        now_s = engine.step(now_s).end_s
    return now_s


def test_pool_evicts_the_least_recently_used_block_past_capacity() -> None:
    pool = SharedKVPool(2)
    pool.store(1)
    pool.store(2)
    pool.load(1)  # 2 is now the least recently used
    pool.store(3)
    assert 1 in pool and 3 in pool and 2 not in pool and len(pool) == 2
    pool.store(1)  # a block already there is touched, not stored again
    pool.store(4)
    assert 1 in pool and 4 in pool and 3 not in pool
    assert pool.stored_blocks_total == 4 and pool.loaded_blocks_total == 1


def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        SharedKVPool(0)


def test_a_block_sealed_in_one_cache_is_a_pool_block_for_another() -> None:
    pool = SharedKVPool(100)
    writer, reader = PagedKVCache(8, kv_pool=pool), PagedKVCache(8, kv_pool=pool)
    writer.allocate_anonymous(2)
    writer.seal(11)
    writer.seal(12)
    assert reader.match([11, 12, 13], max_blocks=10) == (0, 0, 2)
    assert reader.match([11, 12], max_blocks=1) == (0, 0, 1)
    reader.acquire_cached([11, 12])  # loaded into the reader's HBM
    assert reader.match([11, 12], max_blocks=10) == (2, 0, 0)
    assert pool.loaded_blocks_total == 2
    assert PagedKVCache(8).match([11, 12], max_blocks=10) == (0, 0, 0)  # no pool, no hit


def test_second_engine_loads_the_first_engines_prefix_from_the_pool() -> None:
    pool = SharedKVPool(10_000)
    first = MockEngine(BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"), kv_pool_link_gb_s=POOL_LINK_GB_S),
                       kv_pool=pool)
    second = MockEngine(BackendSpec(model=MODEL, hardware=CATALOG.hw("b200"), kv_pool_link_gb_s=POOL_LINK_GB_S),
                        kv_pool=pool)
    prefix = tokens(8_000, seed=1)
    first.add_request("a", prefix, max_tokens=1, arrival_s=0.0)
    drain(first)
    second.add_request("b", prefix + tokens(100, seed=2), max_tokens=1, arrival_s=0.0)
    step = second.step(0.0)
    (out,) = step.outputs
    assert out.cached_kv_pool_tokens == out.cached_tokens == 8_000 and out.cached_host_tokens == 0
    # 8,000 tokens × B_kv 131,072 B (Llama-3.1-8B: 2·32 layers·8 KV heads·128·2 B) over 25 GB/s.
    assert step.load_s == pytest.approx(1_048_576_000 / 25e9) == 0.04194304
    assert second.stats.kv_pool_loaded_bytes_total == 1_048_576_000
    assert second.stats.host_kv_loaded_bytes_total == 0
    assert second.stats.external_prefix_cache_hits_tokens == 8_000


def test_an_engine_on_a_pool_needs_a_pool_link() -> None:
    with pytest.raises(ValueError, match="kv_pool_link_gb_s"):
        MockEngine(BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm")), kv_pool=SharedKVPool(10))


def test_a_finished_request_refreshes_its_chain_in_the_pool_deepest_first() -> None:
    """Sealed in prompt order, block 0 would be the pool's oldest and go first, stranding 2 and 3."""
    pool = SharedKVPool(3)
    writer, reader = PagedKVCache(8, kv_pool=pool), PagedKVCache(8, kv_pool=pool)
    writer.allocate_anonymous(3)
    for h in (1, 2, 3):
        writer.seal(h)
    writer.release([1, 2, 3], 0)  # the request ends: 3, then 2, then 1 become the most recent
    pool.store(10)
    pool.store(11)  # two newer blocks push out the two oldest: 3, then 2
    assert reader.match([1, 2, 3], max_blocks=10) == (0, 0, 1)


def test_engines_of_different_models_do_not_share_pool_blocks() -> None:
    pool = SharedKVPool(10_000)
    prompt = tokens(2_000, seed=3)
    engines = {name: MockEngine(BackendSpec(model=CATALOG.model(name), hardware=CATALOG.hw("h100-sxm"),
                                            kv_pool_link_gb_s=POOL_LINK_GB_S), kv_pool=pool)
               for name in ("llama-3.1-8b", "mistral-7b-v0.1")}
    first, other = engines["llama-3.1-8b"], engines["mistral-7b-v0.1"]
    first.add_request("a", prompt, max_tokens=1, arrival_s=0.0)
    drain(first)
    other.add_request("b", prompt, max_tokens=1, arrival_s=0.0)
    (out,) = other.step(0.0).outputs
    assert out.cached_tokens == 0
