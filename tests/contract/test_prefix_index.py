"""One contract suite over every PrefixIndex implementation (memory and Redis).

Each case runs against ``MemoryPrefixIndex``, ``RedisPrefixIndex`` on a real redis-server
and ``RedisPrefixIndex`` on a real 3-master Redis Cluster (its ``redis+cluster://`` URL,
`prefix_index.redis_connect`), like uvicorn's parametrised ``http_protocol_cls``. Expected tiers are worked
out by hand in each case from the semantics in ``prefix_index/base.py``; a seeded random
workload is also checked against a naive reference model written here from those
semantics (linear scans and sorts, no binary search, no chain truncation).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence

import pytest

from prefix_index import BlockMatch, MemoryPrefixIndex, PrefixIndex, TierCapacity
from prefix_index.redis_index import RedisPrefixIndex
from prefix_index.redis_connect import connect
from tests.contract.index_support import CONTRACT_TIMEOUT_S, ROOMY, ZERO, chain, labels


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    if request.param == "memory":
        memory = MemoryPrefixIndex()
        yield memory
        await memory.aclose()
        return
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
    else:
        url = request.getfixturevalue("redis_cluster_nodes").url
    key_prefix: str = request.getfixturevalue("key_prefix")
    connection = connect(url)
    client = connection.client
    try:
        yield RedisPrefixIndex(client, key_prefix=key_prefix, timeout_s=CONTRACT_TIMEOUT_S)
        keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
        if keys:
            await client.delete(*keys)  # a cluster client splits them by slot
    finally:
        await connection.aclose()


async def test_empty_index_matches_nothing_on_every_backend(index: PrefixIndex) -> None:
    capacities = {b: ROOMY for b in ("b1", "b2", "b3")}
    assert await index.match("m1", chain(labels("a", 5)), capacities) == dict.fromkeys(capacities, ZERO)
    assert await index.match("m1", [], capacities) == dict.fromkeys(capacities, ZERO)
    assert await index.match("m1", chain(labels("a", 5)), {}) == {}
    stats = await index.stats()
    assert stats.blocks_by_backend == {}


async def test_longest_prefix_match(index: PrefixIndex) -> None:
    a = labels("a", 10)
    await index.record("m1", "b1", chain(a), ROOMY)
    query = chain(a[:6] + labels("q", 4))
    result = await index.match("m1", query, {"b1": ROOMY})
    assert result == {"b1": BlockMatch(6, 6, 0)}
    # the whole recorded chain and a shorter prefix of it
    assert (await index.match("m1", chain(a), {"b1": ROOMY}))["b1"] == BlockMatch(10, 10, 0)
    assert (await index.match("m1", chain(a[:3]), {"b1": ROOMY}))["b1"] == BlockMatch(3, 3, 0)


async def test_one_call_answers_for_many_backends(index: PrefixIndex) -> None:
    a = labels("a", 12)
    backends = [f"b{i}" for i in range(8)]
    for i, backend_id in enumerate(backends[:7]):
        await index.record("m1", backend_id, chain(a[: i + 2]), ROOMY)  # b_i holds i+2 blocks
    await index.record("m1", backends[7], chain(labels("z", 9)), ROOMY)  # unrelated chain
    result = await index.match("m1", chain(a), dict.fromkeys(backends, ROOMY))
    assert list(result) == backends
    expected = {b: BlockMatch(i + 2, i + 2, 0) for i, b in enumerate(backends[:7])}
    expected[backends[7]] = ZERO
    assert result == expected


async def test_tiers_follow_recency_rank(index: PrefixIndex) -> None:
    cap = TierCapacity(hbm_blocks=4, host_blocks=4)
    old = chain(labels("x", 6))
    await index.record("m1", "b1", old, cap)
    assert (await index.match("m1", old, {"b1": cap}))["b1"] == BlockMatch(6, 4, 2)
    await index.record("m1", "b1", chain(labels("y", 3)), cap)
    # y0..y2 take ranks 0..2, so x0..x5 have ranks 3..8; x5 (rank 8 >= 8) is evicted,
    # x0 (rank 3) is the only one left in HBM, x1..x4 (ranks 4..7) are in the host tier.
    assert (await index.match("m1", old, {"b1": cap}))["b1"] == BlockMatch(5, 1, 4)


async def test_rank_past_the_queried_capacity_counts_as_evicted(index: PrefixIndex) -> None:
    old = chain(labels("x", 6))
    await index.record("m1", "b1", old, ROOMY)
    await index.record("m1", "b1", chain(labels("y", 3)), ROOMY)
    smaller = TierCapacity(hbm_blocks=4, host_blocks=4)
    assert (await index.match("m1", old, {"b1": smaller}))["b1"] == BlockMatch(5, 1, 4)
    assert (await index.match("m1", old, {"b1": TierCapacity(0, 0)}))["b1"] == ZERO


async def test_trimming_evicts_oldest_and_deepest_first(index: PrefixIndex) -> None:
    cap = TierCapacity(hbm_blocks=3, host_blocks=2)
    a, b = chain(labels("a", 4)), chain(labels("b", 4))
    await index.record("m1", "b1", a, cap)
    await index.record("m1", "b1", b, cap)
    # 8 blocks for 5 places: a3, a2, a1 go; a0 (rank 4) stays in the host tier.
    result = await index.match("m1", a, {"b1": cap})
    assert result["b1"] == BlockMatch(1, 0, 1)
    assert (await index.match("m1", b, {"b1": cap}))["b1"] == BlockMatch(4, 3, 1)
    assert (await index.stats()).blocks_by_backend == {"b1": 5}


async def test_a_chain_longer_than_capacity_keeps_a_prefix(index: PrefixIndex) -> None:
    cap = TierCapacity(hbm_blocks=3, host_blocks=2)
    long = chain(labels("l", 12))
    await index.record("m1", "b1", long, cap)
    assert (await index.match("m1", long, {"b1": cap}))["b1"] == BlockMatch(5, 3, 2)
    for k in range(1, 13):  # every prefix sees the same cached prefix: no holes
        assert (await index.match("m1", long[:k], {"b1": cap}))["b1"].matched_blocks == min(k, 5)


async def test_long_chains_of_a_128k_token_prompt(index: PrefixIndex) -> None:
    cap = TierCapacity(hbm_blocks=1000, host_blocks=1500)
    long = chain(labels("L", 2200))  # past two of Redis' ZADD batches (redis_lua.LUA_UNPACK_CHUNK_VALUES)
    await index.record("m1", "b1", long, cap)
    assert (await index.match("m1", long, {"b1": cap}))["b1"] == BlockMatch(2200, 1000, 1200)
    await index.record("m1", "b1", chain(labels("y", 600)), cap)  # pushes 300 past 2500
    assert (await index.match("m1", long, {"b1": cap}))["b1"] == BlockMatch(1900, 400, 1500)


async def test_rerecording_refreshes_a_chain_into_hbm(index: PrefixIndex) -> None:
    cap = TierCapacity(hbm_blocks=4, host_blocks=4)
    x, y = chain(labels("x", 4)), chain(labels("y", 4))
    await index.record("m1", "b1", x, cap)
    await index.record("m1", "b1", y, cap)
    assert (await index.match("m1", x, {"b1": cap}))["b1"] == BlockMatch(4, 0, 4)
    await index.record("m1", "b1", x, cap)
    assert (await index.match("m1", x, {"b1": cap}))["b1"] == BlockMatch(4, 4, 0)
    assert (await index.match("m1", y, {"b1": cap}))["b1"] == BlockMatch(4, 0, 4)


async def test_forget_drops_a_backend_for_every_model(index: PrefixIndex) -> None:
    a = chain(labels("a", 5))
    for model in ("m1", "m2"):
        for backend_id in ("b1", "b2"):
            await index.record(model, backend_id, a, ROOMY)
    await index.forget("b1")
    for model in ("m1", "m2"):
        result = await index.match(model, a, {"b1": ROOMY, "b2": ROOMY})
        assert result == {"b1": ZERO, "b2": BlockMatch(5, 5, 0)}
    assert (await index.stats()).blocks_by_backend == {"b2": 10}
    await index.forget("never-seen")  # no error


async def test_models_do_not_share_entries(index: PrefixIndex) -> None:
    a = chain(labels("a", 5))
    await index.record("m1", "b1", a, ROOMY)
    assert await index.match("m2", a, {"b1": ROOMY}) == {"b1": ZERO}
    # braces and % in model names stay separate models (Redis escapes its hash tag)
    await index.record("m{1}", "b1", a[:2], ROOMY)
    assert (await index.match("m%7B1%7D", a, {"b1": ROOMY}))["b1"] == ZERO
    assert (await index.match("m{1}", a, {"b1": ROOMY}))["b1"] == BlockMatch(2, 2, 0)


async def test_stats_counts_blocks_per_backend(index: PrefixIndex) -> None:
    await index.record("m1", "b1", chain(labels("a", 5)), ROOMY)
    await index.record("m2", "b1", chain(labels("c", 3)), ROOMY)
    await index.record("m1", "10.0.0.7:8000", chain(labels("d", 2)), ROOMY)
    stats = await index.stats()
    assert stats.blocks_by_backend == {"b1": 8, "10.0.0.7:8000": 2}
    assert stats.memory_bytes > 0


async def test_zero_capacity_and_empty_chain_hold_nothing(index: PrefixIndex) -> None:
    await index.record("m1", "b1", chain(labels("a", 3)), TierCapacity(0, 0))
    await index.record("m1", "b2", [], ROOMY)
    assert (await index.stats()).blocks_by_backend == {}


async def test_hashes_outside_64_bits_are_rejected(index: PrefixIndex) -> None:
    for bad in ([-1], [1 << 64]):
        with pytest.raises(ValueError, match="2\\*\\*64"):
            await index.record("m1", "b1", bad, ROOMY)
        with pytest.raises(ValueError, match="2\\*\\*64"):
            await index.match("m1", bad, {"b1": ROOMY})
    edge = [0, (1 << 64) - 1]
    await index.record("m1", "b1", edge, ROOMY)
    assert (await index.match("m1", edge, {"b1": ROOMY}))["b1"] == BlockMatch(2, 2, 0)


class NaiveIndex:
    """Reference model of base.py's semantics: whole chains, sorts, linear scans."""

    def __init__(self) -> None:
        self.clock = 0
        self.sets: dict[tuple[str, str], dict[int, int]] = {}

    def record(self, model: str, backend_id: str, hashes: Sequence[int], cap: TierCapacity) -> None:
        held = self.sets.setdefault((model, backend_id), {})
        for depth, h in enumerate(hashes):
            held[h] = self.clock + len(hashes) - 1 - depth
        self.clock += len(hashes)
        keep = sorted(held, key=held.__getitem__, reverse=True)[: cap.total_blocks]
        self.sets[(model, backend_id)] = {h: held[h] for h in keep}

    def match(self, model: str, hashes: Sequence[int], caps: dict[str, TierCapacity]) -> dict[str, BlockMatch]:
        out = {}
        for backend_id, cap in caps.items():
            held = self.sets.get((model, backend_id), {})
            scores = sorted(held.values(), reverse=True)
            matched = hbm = 0
            for h in hashes:
                if h not in held or scores.index(held[h]) >= cap.total_blocks:
                    break
                matched += 1
                hbm += scores.index(held[h]) < cap.hbm_blocks
            out[backend_id] = BlockMatch(matched, hbm, matched - hbm)
        return out


async def test_random_workload_agrees_with_reference_model(index: PrefixIndex) -> None:
    rnd = random.Random(20240611)
    documents = [labels(f"d{r}-", 14) for r in range(3)]
    caps = {"b1": TierCapacity(3, 4), "b2": TierCapacity(5, 0), "b3": TierCapacity(2, 9)}
    reference = NaiveIndex()
    for step in range(80):
        doc = rnd.choice(documents)
        shared = rnd.randint(0, len(doc))
        query = chain(doc[:shared] + labels(f"s{step}-", rnd.randint(0, 3)))
        if not query:
            continue
        assert await index.match("m1", query, caps) == reference.match("m1", query, caps), step
        backend_id = rnd.choice(list(caps))
        await index.record("m1", backend_id, query, caps[backend_id])
        reference.record("m1", backend_id, query, caps[backend_id])
    held = {b: len(s) for (_, b), s in reference.sets.items() if s}
    assert (await index.stats()).blocks_by_backend == held


async def test_long_random_workload_agrees_with_reference_model(index: PrefixIndex) -> None:
    # Long enough that the memory index's dead record segments pile up and get compacted
    # (renumbered) several times; shared prefixes of varying length stale segments in part.
    rnd = random.Random(7)
    documents = [labels(f"L{r}-", 12) for r in range(4)]
    caps = {"b1": TierCapacity(4, 4), "b2": TierCapacity(6, 0), "b3": TierCapacity(1, 3)}
    reference = NaiveIndex()
    for step in range(1200):
        doc = rnd.choice(documents)
        query = chain(doc[: rnd.randint(1, len(doc))] + labels(f"t{step % 5}-", rnd.randint(0, 2)))
        if step % 7 == 0:
            assert await index.match("m1", query, caps) == reference.match("m1", query, caps), step
        backend_id = rnd.choice(list(caps))
        await index.record("m1", backend_id, query, caps[backend_id])
        reference.record("m1", backend_id, query, caps[backend_id])
    for doc in documents:
        query = chain(doc)
        assert await index.match("m1", query, caps) == reference.match("m1", query, caps)
    held = {b: len(s) for (_, b), s in reference.sets.items() if s}
    assert (await index.stats()).blocks_by_backend == held


async def test_rerecording_the_chain_on_top_or_a_prefix_of_it_changes_no_later_answer(index: PrefixIndex) -> None:
    # The Redis script writes no scores for a chain that already holds ranks 0..n-1 (redis_lua):
    # every later match, tier split and trim must be as if it had re-touched the chain.
    cap = TierCapacity(hbm_blocks=3, host_blocks=5)
    a, c, b = labels("a", 6), labels("a", 3) + labels("c", 2), labels("b", 4)
    await index.record("m1", "b1", chain(a), cap)  # a0..a5 ranks 0..5
    await index.record("m1", "b1", chain(c), cap)  # a0 a1 a2 c0 c1, then a3 a4 a5
    assert (await index.match("m1", chain(a), {"b1": cap}))["b1"] == BlockMatch(6, 3, 3)
    await index.record("m1", "b1", chain(a), cap)  # a0..a5 on top again, c0 c1 at ranks 6, 7
    await index.record("m1", "b1", chain(a), cap)  # on top already
    await index.record("m1", "b1", chain(a[:4]), cap)  # a prefix of the chain on top
    assert (await index.match("m1", chain(c), {"b1": cap}))["b1"] == BlockMatch(5, 3, 2)
    await index.record("m1", "b1", chain(b), cap)  # b0..b3, a0..a3 kept; a4 a5 c0 c1 trimmed
    assert await index.match("m1", chain(a), {"b1": cap, "b2": cap}) == {"b1": BlockMatch(4, 0, 4), "b2": ZERO}
    assert (await index.match("m1", chain(c), {"b1": cap}))["b1"] == BlockMatch(3, 0, 3)
    small = TierCapacity(hbm_blocks=2, host_blocks=1)
    await index.record("m1", "b1", chain(b), small)  # on top, then trimmed to 3 blocks
    assert await index.match("m1", chain(b), {"b1": cap}) == {"b1": BlockMatch(3, 3, 0)}
    assert await index.match("m1", chain(b), {"b1": small}) == {"b1": BlockMatch(3, 2, 1)}
    assert (await index.match("m1", chain(a), {"b1": cap}))["b1"] == ZERO
    assert (await index.stats()).blocks_by_backend == {"b1": 3}


async def test_repeated_and_prefix_records_agree_with_reference_model(index: PrefixIndex) -> None:
    # Biased towards what the Redis script short-cuts (a backend's last chain, or a prefix of it,
    # recorded again), with capacities that change between records (trims after such a record)
    # and host tiers (the HBM split reuses the matched prefix's rank); shared prefixes as in
    # bench/overhead.py (groups of prompts sharing a head).
    rnd = random.Random(2025)
    documents = [labels(f"g{g}-", 10) for g in range(3)]
    capacities = [TierCapacity(4, 4), TierCapacity(2, 6), TierCapacity(9, 0), TierCapacity(3, 2), TierCapacity(0, 5)]
    backends = ["b1", "b2", "b3"]
    last: dict[str, list[int]] = {}
    reference = NaiveIndex()
    for step in range(400):
        backend_id = rnd.choice(backends)
        roll = rnd.random()
        if backend_id in last and roll < 0.35:
            query = last[backend_id]
        elif backend_id in last and roll < 0.55:
            query = last[backend_id][: rnd.randint(1, len(last[backend_id]))]
        else:
            doc = rnd.choice(documents)
            query = chain(doc[: rnd.randint(1, len(doc))] + labels(f"u{step}-", rnd.randint(0, 3)))
        capacity = rnd.choice(capacities)
        await index.record("m1", backend_id, query, capacity)
        reference.record("m1", backend_id, query, capacity)
        last[backend_id] = query
        caps = {b: rnd.choice(capacities) for b in backends}
        probe = last[rnd.choice(list(last))] if rnd.random() < 0.5 else chain(rnd.choice(documents))
        assert await index.match("m1", probe, caps) == reference.match("m1", probe, caps), step
    held = {b: len(s) for (_, b), s in reference.sets.items() if s}
    assert (await index.stats()).blocks_by_backend == held
