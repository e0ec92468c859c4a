"""One contract suite over every PrefixIndex implementation (memory and Redis).

Each case runs against ``MemoryPrefixIndex`` and ``RedisPrefixIndex`` (a real
redis-server), like uvicorn's parametrised ``http_protocol_cls``. Expected tiers are worked
out by hand in each case from the semantics in ``prefix_index/base.py``; a seeded random
workload is also checked against a naive reference model written here from those
semantics (linear scans and sorts, no binary search, no chain truncation).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

import pytest
import redis.asyncio as redis

from prefix_index import (
    BlockMatch,
    IndexUnavailable,
    MemoryPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    TierCapacity,
    block_hashes,
    chain_seed,
)
from tests.support.redis_server import free_port

BLOCK_BYTES = 16
SEED = chain_seed("m1", None)
ROOMY = TierCapacity(hbm_blocks=1000, host_blocks=1000)
ZERO = BlockMatch(0, 0, 0)
# Generous for a loaded CI machine; the production default (50 ms) is exercised below.
CONTRACT_TIMEOUT_S = 2.0


def chain(labels: Sequence[str]) -> list[int]:
    """Chained hashes of one block per label (labels padded to a full block)."""
    data = b"".join(label.encode().ljust(BLOCK_BYTES, b".")[:BLOCK_BYTES] for label in labels)
    hashes = block_hashes(data, block_size_bytes=BLOCK_BYTES, seed=SEED)
    assert len(hashes) == len(labels)
    return hashes


def labels(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    if request.param == "memory":
        memory = MemoryPrefixIndex()
        yield memory
        await memory.aclose()
        return
    url: str = request.getfixturevalue("redis_url")
    key_prefix: str = request.getfixturevalue("key_prefix")
    client = redis.Redis.from_url(url)
    try:
        yield RedisPrefixIndex(client, key_prefix=key_prefix, timeout_s=CONTRACT_TIMEOUT_S)
        keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


OwnIndex = tuple[RedisPrefixIndex, redis.Redis]


@pytest.fixture
async def own_redis_index(redis_url: str, key_prefix: str) -> AsyncIterator[OwnIndex]:
    """A RedisPrefixIndex with its own client, plus a plain client to act on Redis; keys removed after."""
    index = RedisPrefixIndex.from_url(redis_url, key_prefix=key_prefix, timeout_s=CONTRACT_TIMEOUT_S)
    client = redis.Redis.from_url(redis_url)
    try:
        yield index, client
    finally:
        await index.aclose()
        keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


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
    long = chain(labels("L", 2200))  # past Redis' ZADD batch of 1000 pairs
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


# --- Redis only: failures become IndexUnavailable within the deadline ---------------


@pytest.fixture
async def silent_server_url() -> AsyncIterator[str]:
    """A TCP server that accepts and reads but never answers (a stuck Redis)."""
    handlers: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.append(writer)
        while await reader.read(4096):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
        if handlers:
            await asyncio.wait(handlers)


async def _assert_every_call_unavailable(index: RedisPrefixIndex) -> None:
    a = chain(labels("a", 3))
    with pytest.raises(IndexUnavailable) as caught:
        await index.match("m1", a, {"b1": ROOMY})
    assert caught.value.__cause__ is not None
    with pytest.raises(IndexUnavailable):
        await index.record("m1", "b1", a, ROOMY)


@pytest.mark.redis
async def test_redis_nothing_listening_is_unavailable() -> None:
    index = RedisPrefixIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.05)
    try:
        await _assert_every_call_unavailable(index)
        with pytest.raises(IndexUnavailable):
            await index.forget("b1")
        with pytest.raises(IndexUnavailable):
            await index.stats()
    finally:
        await index.aclose()


@pytest.mark.redis
async def test_redis_that_never_answers_times_out(silent_server_url: str) -> None:
    index = RedisPrefixIndex.from_url(silent_server_url, timeout_s=0.05, admin_timeout_s=0.05)
    try:
        await _assert_every_call_unavailable(index)
        with pytest.raises(IndexUnavailable) as caught:
            await index.stats()
        assert isinstance(caught.value.__cause__, TimeoutError)
    finally:
        await index.aclose()


@pytest.mark.redis
async def test_redis_client_stays_usable_after_a_timeout(redis_url: str, key_prefix: str) -> None:
    # No socket timeout: the deadline then lands in the read, not in redis-py's
    # asyncio.wait_for around the write (which on 3.11 may swallow it, gh-86296).
    client = redis.Redis.from_url(redis_url, socket_timeout=None)
    try:
        hasty = RedisPrefixIndex(client, key_prefix=key_prefix, timeout_s=1e-9)
        steady = RedisPrefixIndex(client, key_prefix=key_prefix, timeout_s=CONTRACT_TIMEOUT_S)
        a, b = chain(labels("a", 4)), chain(labels("b", 2))
        await steady.record("m1", "b1", a, ROOMY)
        for _ in range(5):  # a cancelled command must not leave its reply for the next one
            with pytest.raises(IndexUnavailable):
                await hasty.match("m1", a, {"b1": ROOMY})
            with pytest.raises(IndexUnavailable):
                await hasty.record("m1", "b2", b, ROOMY)
            # a stale reply would have the wrong shape (3 ints, or a record's reply)
            result = await steady.match("m1", a, {"b1": ROOMY, "b2": ROOMY})
            assert result == {"b1": BlockMatch(4, 4, 0), "b2": ZERO}
        await steady.record("m1", "b2", b, ROOMY)
        assert (await steady.match("m1", b, {"b2": ROOMY}))["b2"] == BlockMatch(2, 2, 0)
        await hasty.aclose()  # does not close a client it does not own
        assert await client.ping()
    finally:
        keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.mark.redis
async def test_redis_reloads_its_scripts_after_a_flush(own_redis_index: OwnIndex) -> None:
    index, client = own_redis_index
    a = chain(labels("a", 3))
    await index.record("m1", "b1", a, ROOMY)
    await client.script_flush()
    await index.record("m1", "b2", a, ROOMY)
    await client.script_flush()
    result = await index.match("m1", a, {"b1": ROOMY, "b2": ROOMY})
    assert result == {"b1": BlockMatch(3, 3, 0), "b2": BlockMatch(3, 3, 0)}


@pytest.mark.redis
async def test_redis_calls_of_one_loop_turn_go_out_as_one_batch(own_redis_index: OwnIndex) -> None:
    index, client = own_redis_index
    a, b = chain(labels("a", 6)), chain(labels("b", 3))
    tight = TierCapacity(hbm_blocks=2, host_blocks=2)
    coalescer = index._coalescer
    sent = coalescer.batches_sent
    # Queued in one turn: two records (b1 over a tight capacity), then matches that
    # must see them (records run first in the batch), plus another model's match.
    results = await asyncio.gather(
        index.record("m1", "b1", a, tight),
        index.record("m1", "b2", b, ROOMY),
        index.match("m1", a, {"b1": tight, "b2": ROOMY}),
        index.match("m1", b, {"b1": tight, "b2": ROOMY}),
        index.match("m2", a, {"b1": ROOMY}),
    )
    assert coalescer.batches_sent - sent == 2  # one per model
    # b1 keeps a's first 4 blocks (the head is the most recent), 2 of them in HBM
    assert results[2] == {"b1": BlockMatch(4, 2, 2), "b2": ZERO}
    assert results[3] == {"b1": ZERO, "b2": BlockMatch(3, 3, 0)}
    assert results[4] == {"b1": ZERO}
    # Sent alone, a call still answers; the registry learned both new keys.
    assert (await index.match("m1", a[:2], {"b1": tight}))["b1"] == BlockMatch(2, 2, 0)
    assert (await index.stats()).blocks_by_backend == {"b1": 4, "b2": 3}
    await index.forget("b2")
    assert (await index.stats()).blocks_by_backend == {"b1": 4}


@pytest.mark.redis
async def test_redis_records_wait_behind_a_record_batch_in_flight_and_matches_do_not(own_redis_index: OwnIndex) -> None:
    index, client = own_redis_index
    a, b = chain(labels("a", 5)), chain(labels("b", 5))
    coalescer = index._coalescer
    # A first batch that keeps Redis busy for milliseconds (a 20,000-block record).
    slow = chain(labels("s", 20_000))
    first = asyncio.ensure_future(index.record("m1", "b1", slow, TierCapacity(30_000, 0)))
    while coalescer.batches_sent == 0:  # until the first batch is out, waiting for Redis
        await asyncio.sleep(0)
    assert not first.done()
    sent, calls = coalescer.batches_sent, coalescer.calls_sent
    given_up = asyncio.ensure_future(index.record("m1", "b3", a, ROOMY))
    await asyncio.sleep(0)  # queued behind the record batch in flight ...
    given_up.cancel()  # ... and its caller gives up (as a request past its deadline does)
    later = [index.record("m1", "b1", a, ROOMY), index.record("m1", "b2", b, ROOMY),
             index.match("m1", b, {"b1": ROOMY, "b2": ROOMY})]
    results = await asyncio.gather(first, *later)
    # The match went at once, alone; the two live records went together once the first
    # batch answered; the abandoned one never. (Whether Redis ran the match before the
    # records depends on its connections: a match may see records issued after it.)
    assert results[3]["b1"] == ZERO
    assert coalescer.batches_sent - sent == 2
    assert coalescer.calls_sent - calls == 3
    assert coalescer.calls_abandoned == 1
    assert await index.match("m1", b, {"b2": ROOMY, "b3": ROOMY}) == {"b2": BlockMatch(5, 5, 0), "b3": ZERO}
    assert (await index.match("m1", slow[:3], {"b1": TierCapacity(30_000, 0)}))["b1"] == BlockMatch(3, 3, 0)
