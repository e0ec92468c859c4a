"""The Redis index only: failures become IndexUnavailable within the deadline; batching; scripts.

The behaviours both implementations share are in test_prefix_index.py (the contract suite).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from prefix_index import BlockMatch, IndexUnavailable, MemoryPrefixIndex, TierCapacity
from prefix_index.redis_index import RedisPrefixIndex
from tests.contract.index_support import CONTRACT_TIMEOUT_S, ROOMY, ZERO, chain, drop_keys, labels
from tests.support.redis_server import free_port


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
        await drop_keys(client, key_prefix)
        await client.aclose()


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
        await drop_keys(client, key_prefix)
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


@pytest.mark.redis
async def test_redis_a_chain_already_on_top_is_not_rescored_and_the_clock_still_advances(
    own_redis_index: OwnIndex,
) -> None:
    index, client = own_redis_index
    a, b = chain(labels("a", 5)), chain(labels("b", 3))
    await index.record("m1", "b1", a, ROOMY)
    key, clock = index._blocks_key("m1", "b1"), index._clock_key("m1")
    scores = await client.zrange(key, 0, -1, withscores=True)
    await index.record("m1", "b1", a, ROOMY)  # holds ranks 0..4 already: nothing to write
    await index.record("m1", "b1", a[:3], ROOMY)  # a prefix of the chain on top: likewise
    assert await client.zrange(key, 0, -1, withscores=True) == scores
    assert int(await client.get(clock)) == 5 + 5 + 3
    tight = TierCapacity(hbm_blocks=2, host_blocks=4)
    await index.record("m1", "b1", b, tight)  # above a, scored from the advanced clock; a3, a4 trimmed
    assert [s for _, s in await client.zrevrange(key, 0, 2, withscores=True)] == [16, 15, 14]
    assert await index.match("m1", a, {"b1": tight}) == {"b1": BlockMatch(3, 0, 3)}
    assert await index.match("m1", b, {"b1": tight}) == {"b1": BlockMatch(3, 2, 1)}


@pytest.mark.redis
async def test_redis_one_match_over_hundreds_of_backends_and_huge_capacities(own_redis_index: OwnIndex) -> None:
    # Each backend's key index and capacities travel packed (redis_lua.MATCH_SPEC_FORMAT): key
    # indices past one byte, capacities past 32 bits, and zero tiers give what the memory index gives.
    index, _ = own_redis_index
    memory = MemoryPrefixIndex()
    a = chain(labels("a", 9))
    capacities = {f"b{i}": TierCapacity(hbm_blocks=i % 5, host_blocks=(i % 3) * 2) for i in range(300)}
    capacities["huge"] = TierCapacity(hbm_blocks=2**40 + 3, host_blocks=2**41)
    for i, (backend_id, capacity) in enumerate(capacities.items()):
        if i % 4 != 1:
            for ix in (index, memory):
                await ix.record("m1", backend_id, a[: 1 + i % 9], capacity)
    result = await index.match("m1", a, capacities)
    assert result == await memory.match("m1", a, capacities)
    assert result["huge"] == BlockMatch(4, 4, 0)  # the 301st backend: a[:1 + 300 % 9]
    assert sum(m.host_blocks > 0 for m in result.values()) > 50
