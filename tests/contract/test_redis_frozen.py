"""The Redis index when the gateway's loop is busy, when Redis is frozen, and its keys' expiry (issue 16).

Real ``redis-server`` processes on 127.0.0.1: the shared one for the busy-loop and TTL tests,
a private one per breaker test, SIGSTOPped (``frozen`` always SIGCONTs it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as redis

from prefix_index import (
    NO_MATCH,
    BlockMatch,
    BreakerIndex,
    CircuitBreaker,
    IndexCircuitOpen,
    IndexUnavailable,
)
from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S
from prefix_index.redis_index import RedisPrefixIndex
from tests.contract.index_support import ROOMY, chain, drop_keys, labels
from tests.support.redis_server import frozen, redis_process

pytestmark = pytest.mark.redis

TIMEOUT_S = DEFAULT_TIMEOUT_S  # the gateway's default index deadline
STALL_S = 0.08  # a CPU-bound stretch of the gateway's loop, longer than the deadline


@pytest.fixture
async def index_and_client(redis_url: str, key_prefix: str) -> AsyncIterator[tuple[RedisPrefixIndex, redis.Redis]]:
    """The index as the gateway builds it (its own client, 50 ms deadline), plus a plain client."""
    index = RedisPrefixIndex.from_url(redis_url, key_prefix=key_prefix, timeout_s=TIMEOUT_S)
    client = redis.Redis.from_url(redis_url)
    try:
        yield index, client
    finally:
        await index.aclose()
        await drop_keys(client, key_prefix)
        await client.aclose()


@pytest.mark.parametrize("stall_after_s", [None, 0.002], ids=["before-the-send", "after-the-send"])
async def test_a_busy_event_loop_is_not_an_index_timeout(index_and_client, stall_after_s: float | None) -> None:
    index, _ = index_and_client
    a = chain(labels("a", 8))
    await index.record("m1", "b1", a, ROOMY)  # connected and scripts loaded
    loop = asyncio.get_running_loop()

    def stall() -> None:  # CPU-bound work holds the loop for 80 ms
        if stall_after_s is None:
            loop.call_soon(time.sleep, STALL_S)  # runs before the batch is even sent
        else:
            loop.call_later(stall_after_s, time.sleep, STALL_S)  # Redis's answer waits in the socket

    for _ in range(5):
        stall()
        assert await index.match("m1", a, {"b1": ROOMY}) == {"b1": BlockMatch(8, 8, 0)}
        stall()
        await index.record("m1", "b2", a[:4], ROOMY)
    assert (await index.match("m1", a, {"b2": ROOMY}))["b2"] == BlockMatch(4, 4, 0)


async def test_every_key_a_record_writes_expires_and_each_write_refreshes_it(redis_url: str, key_prefix: str) -> None:
    now = [0.0]
    ttl_s = 1000
    index = RedisPrefixIndex(redis.Redis.from_url(redis_url), key_prefix=key_prefix, key_ttl_s=ttl_s,
                             owns_client=True, clock=lambda: now[0])
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    blocks, clock_key, registry = (f"{key_prefix}:{{m1}}:blocks:b1", f"{key_prefix}:{{m1}}:clock",
                                   f"{key_prefix}:backend-models:b1")
    try:
        a = chain(labels("a", 4))
        await index.record("m1", "b1", a, ROOMY)
        assert await client.smembers(registry) == {"m1"}
        assert await client.ttl(blocks) == await client.ttl(clock_key) == ttl_s
        assert await client.ttl(registry) == 1250  # a quarter more: it must outlive the keys it lists

        for key in (blocks, clock_key, registry):
            await client.expire(key, 5)  # as if the last write were long ago
        await index.record("m1", "b1", a[:2], ROOMY)
        assert await client.ttl(blocks) == await client.ttl(clock_key) == ttl_s  # refreshed by the write
        assert await client.ttl(registry) <= 5  # not yet due: written once per quarter TTL per process
        now[0] += ttl_s / 4
        await index.record("m1", "b1", a[:2], ROOMY)
        assert await client.ttl(registry) == 1250

        # A match only reads: it refreshes nothing.
        await client.expire(blocks, 5)
        assert (await index.match("m1", a, {"b1": ROOMY}))["b1"] == BlockMatch(4, 4, 0)
        assert await client.ttl(blocks) <= 5
    finally:
        await index.aclose()
        await drop_keys(client, key_prefix)
        await client.aclose()


@pytest.fixture
def stoppable_redis() -> Iterator[tuple[str, object]]:
    """A private redis-server this test may SIGSTOP (with ``frozen``)."""
    with redis_process() as (url, proc):
        yield url, proc


async def test_a_frozen_redis_opens_the_breaker_then_a_probe_closes_it(stoppable_redis) -> None:
    url, proc = stoppable_redis
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=3, open_s=1.0, max_open_s=4.0)
    index = BreakerIndex(RedisPrefixIndex.from_url(url, timeout_s=TIMEOUT_S), breaker, clock=lambda: now[0])
    a = chain(labels("a", 6))
    both = {"b1": ROOMY, "b2": ROOMY}
    try:
        await index.record("m1", "b1", a, ROOMY)
        with frozen(proc):
            for _ in range(3):  # each waits out the deadline
                with pytest.raises(IndexUnavailable) as caught:
                    await index.match("m1", a, both)
                assert not isinstance(caught.value, IndexCircuitOpen)
            assert breaker.degraded
            start = time.monotonic()
            for _ in range(100):  # then skipped at once
                with pytest.raises(IndexCircuitOpen):
                    await index.match("m1", a, both)
            assert time.monotonic() - start < TIMEOUT_S  # 100 skips take less than one deadline
            with pytest.raises(IndexCircuitOpen):
                await index.record("m1", "b2", a, ROOMY)
            with pytest.raises(IndexCircuitOpen):
                await index.forget("b1")  # b1 restarted during the outage: owed
            assert index.owed_forgets == {"b1"}
            now[0] += 1.0  # the probe: still frozen, so open again, for 2 s
            with pytest.raises(IndexUnavailable):
                await index.match("m1", a, both)
            now[0] += 1.9
            with pytest.raises(IndexCircuitOpen):
                await index.match("m1", a, both)
        now[0] += 0.1  # Redis is back; the next match is the probe and closes the breaker
        assert await index.match("m1", a, both) == {"b1": NO_MATCH, "b2": NO_MATCH}  # b1's forget is owed
        assert not breaker.degraded and breaker.opens == 2
        await index.record("m1", "b2", a[:3], ROOMY)  # pays the forget first
        assert index.owed_forgets == set()
        assert await index.match("m1", a, both) == {"b1": NO_MATCH, "b2": BlockMatch(3, 3, 0)}
        assert (await index.stats()).blocks_by_backend == {"b2": 3}
    finally:
        await index.aclose()


async def test_a_cancelled_probe_leaves_the_next_call_to_probe(stoppable_redis) -> None:
    url, proc = stoppable_redis
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, open_s=1.0, max_open_s=1.0)
    index = BreakerIndex(RedisPrefixIndex.from_url(url, timeout_s=TIMEOUT_S), breaker, clock=lambda: now[0])
    a = chain(labels("a", 2))
    try:
        await index.record("m1", "b1", a, ROOMY)
        with frozen(proc):
            with pytest.raises(IndexUnavailable):
                await index.match("m1", a, {"b1": ROOMY})
            now[0] += 1.0
            probe = asyncio.ensure_future(index.match("m1", a, {"b1": ROOMY}))
            await asyncio.sleep(0)  # the probe is out, waiting for the frozen Redis
            with pytest.raises(IndexCircuitOpen):  # only one probe at a time
                await index.match("m1", a, {"b1": ROOMY})
            probe.cancel()  # its request went away
            with pytest.raises(asyncio.CancelledError):
                await probe
        assert await index.match("m1", a, {"b1": ROOMY}) == {"b1": BlockMatch(2, 2, 0)}  # the new probe
        assert not breaker.degraded
    finally:
        await index.aclose()
