"""The KV-event subscriber against a real ZMQ publisher (vLLM's protocol, tests/support) on 127.0.0.1:
events by value, gaps repaired by replay, reordering, a killed subscriber, a restarted engine, an
endpoint down at start, malformed payloads, replicas sharing one Redis, Redis down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from fleet_config.kv_events import KvEventsEntry
from gateway.backends.kv_events import KvEventSubscriber, Mode
from gateway.telemetry.kv_events import KvEventsTelemetry
from prefix_index.engine_index import EngineIndex, ExactMatch
from prefix_index.engine_memory import MemoryEngineIndex
from prefix_index.engine_redis import RedisEngineIndex
from tests.contract.index_support import drop_keys
from tests.support.kv_events_publisher import KvEventPublisher
from tests.support.kv_events_wire import cleared, removed, stored
from tests.support.redis_server import free_port, redis_process

pytestmark = pytest.mark.integration

M, B = "m1", "b1"
T = list(range(500, 532))  # 8 blocks of 4 tokens
DEADLINE_S = 10.0


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll ``predicate`` (every 10 ms) until it holds, or fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def blocks(first: int, n: int, *, parent: int | None = None, medium: str = "GPU") -> dict[str, Any]:
    """BlockStored of blocks ``first .. first+n-1`` of T, engine hash = 1000 + block number."""
    return stored([1000 + i for i in range(first, first + n)], parent, T[4 * first: 4 * (first + n)], 4,
                  medium=medium)


class Harness:
    """Subscribers (each its own task) on a shared index and one ZMQ context."""

    def __init__(self, index: EngineIndex) -> None:
        self.index = index
        self.ctx = zmq.asyncio.Context()
        self.telemetry = KvEventsTelemetry(CollectorRegistry())
        self.tasks: list[asyncio.Task[None]] = []

    def subscribe(self, publisher: KvEventPublisher, *, replay: bool = True, endpoint: str | None = None,
                  backend_id: str = B, index: EngineIndex | None = None,
                  **options: Any) -> tuple[KvEventSubscriber, asyncio.Task]:
        entry = KvEventsEntry(endpoint=endpoint or publisher.endpoint,
                              replay_endpoint=publisher.replay_endpoint if replay and publisher.with_replay else None)
        sub = KvEventSubscriber(backend_id, M, entry, index or self.index, self.ctx, self.telemetry,
                                connect_timeout_s=0.2, replay_timeout_s=1.0, **options)
        task = asyncio.create_task(sub.run())
        self.tasks.append(task)
        return sub, task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness(MemoryEngineIndex())
    yield h
    await h.close()


@pytest.fixture
async def publisher() -> AsyncIterator[KvEventPublisher]:
    pub = await KvEventPublisher().start()
    yield pub
    await pub.stop()


async def exact(index: EngineIndex, tokens: list[int] = T) -> ExactMatch:
    return (await index.match(M, tokens, {B: 4}))[B]


async def synced(sub: KvEventSubscriber, seq: int) -> None:
    await until(lambda: sub.state is not None and sub.state.last_seq == seq, f"seq {seq} applied")


async def test_stored_removed_and_cleared_by_value(harness: Harness, publisher: KvEventPublisher) -> None:
    sub, _ = harness.subscribe(publisher)
    await until(lambda: sub.mode is Mode.EXACT, "exact after the empty catch-up")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 3)])
    await publisher.publish([blocks(3, 2, parent=1002), blocks(1, 2, parent=1000, medium="CPU")])
    await synced(sub, 1)
    assert await exact(harness.index) == ExactMatch(5, 0, 4)
    await publisher.publish([removed([1001, 1004])])
    await synced(sub, 2)
    assert await exact(harness.index) == ExactMatch(1, 2, 4)  # block 1, 2 on the host; block 3 after a miss
    assert sub.state.blocks == {**sub.state.blocks} and sub.mode is Mode.EXACT
    await publisher.publish([cleared()])
    await synced(sub, 3)
    assert await exact(harness.index) == ExactMatch(0, 0, 4)
    assert sub.counts == {"applied": 4, "duplicate": 0, "gap": 0, "replayed": 0, "malformed": 0}
    assert harness.telemetry.mode.labels(B, "exact")._value.get() == 1.0
    assert harness.telemetry.batches.labels(B, "applied")._value.get() == 4


async def test_a_dropped_batch_is_replayed_and_a_late_copy_is_a_duplicate(harness: Harness,
                                                                         publisher: KvEventPublisher) -> None:
    sub, _ = harness.subscribe(publisher)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 2)])
    await publisher.publish([blocks(2, 2, parent=1001)], send=False)  # dropped on the way
    await publisher.publish([blocks(4, 2, parent=1003)])  # seq 2: finds the gap, replays 1 and 2
    await synced(sub, 2)
    assert await exact(harness.index) == ExactMatch(6, 0, 4)
    assert publisher.replay_requests == [0, 1]  # the catch-up on connecting, then the gap
    await publisher.resend(1)  # the dropped batch arrives late: out of order
    await publisher.publish([blocks(6, 1, parent=1005)])
    await synced(sub, 3)
    assert sub.counts == {"applied": 2, "duplicate": 1, "gap": 1, "replayed": 2, "malformed": 0}
    assert await exact(harness.index) == ExactMatch(7, 0, 4) and sub.mode is Mode.EXACT


async def test_a_killed_subscriber_restarts_and_catches_up(harness: Harness, publisher: KvEventPublisher) -> None:
    sub, task = harness.subscribe(publisher)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 2)])
    await synced(sub, 0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await publisher.publish([blocks(2, 2, parent=1001)])  # nobody listening
    await publisher.publish([removed([1000])])
    again, _ = harness.subscribe(publisher)
    await synced(again, 2)
    assert again.mode is Mode.EXACT and again.counts["replayed"] == 2
    assert await exact(harness.index) == ExactMatch(0, 0, 4)  # block 0 gone: nothing from the start
    assert (await harness.index.state(M, B)).engine_blocks == 3


async def test_an_engine_restart_with_a_fresh_stream_clears_and_resyncs(harness: Harness) -> None:
    old = await KvEventPublisher().start()
    sub, _ = harness.subscribe(old)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await old.wait_subscribed()
    await old.publish([blocks(0, 4)])
    await old.publish([])
    await synced(sub, 1)
    await old.stop()
    await until(lambda: sub.mode is Mode.APPROXIMATE, "approximate once the publisher is gone")
    new = await KvEventPublisher(port=old.port, replay_port=old.replay_port).start()  # seq from 0 again
    try:
        await new.publish([blocks(4, 1, parent=None)])  # before the subscriber is back: buffered for replay
        await until(lambda: sub.stream_restarts == 1 and sub.mode is Mode.EXACT, "the new stream taken up")
        assert sub.state.last_seq == 0
        assert await exact(harness.index) == ExactMatch(0, 0, 4)  # the old engine's blocks are gone
        assert await exact(harness.index, T[16:20]) == ExactMatch(1, 0, 4)
    finally:
        await new.stop()


async def test_endpoint_down_at_start_is_approximate_then_exact(harness: Harness,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    port, replay_port = free_port(), free_port()
    down = KvEventPublisher(port=port, replay_port=replay_port)
    caplog.set_level(logging.WARNING, "kappa_gateway.kv_events")
    sub, _ = harness.subscribe(down)  # its ports are known before it binds them
    await until(lambda: "no publisher at tcp://127.0.0.1" in caplog.text, "the log line")
    assert sub.mode is Mode.APPROXIMATE and [r.levelname for r in caplog.records] == ["WARNING"]
    assert harness.telemetry.mode.labels(B, "approximate")._value.get() == 1.0
    await down.start()
    try:
        await down.publish([blocks(0, 1)])
        await until(lambda: sub.mode is Mode.EXACT and sub.state is not None, "exact once it is up")
        assert await exact(harness.index) == ExactMatch(1, 0, 4)
    finally:
        await down.stop()


async def test_a_malformed_payload_is_counted_and_skipped(harness: Harness, publisher: KvEventPublisher) -> None:
    sub, _ = harness.subscribe(publisher)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 1)])
    await publisher.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"], buffer_seq=1)
    await publisher.send_raw([b"", b"\x01", b""])  # a bad sequence frame
    await publisher.publish([blocks(1, 1, parent=1000)])
    await synced(sub, 2)
    assert sub.counts["malformed"] == 2 and sub.counts["applied"] == 3
    mode, reason = sub.mode_and_reason()
    assert mode is Mode.DEGRADED and reason.startswith("partial state")  # batch 1's events are unknown
    await publisher.publish([cleared(), blocks(0, 2)])
    await synced(sub, 3)
    assert sub.mode is Mode.EXACT and await exact(harness.index) == ExactMatch(2, 0, 4)


async def test_without_a_replay_endpoint_a_gap_drops_the_entries(harness: Harness) -> None:
    pub = await KvEventPublisher(replay=False).start()
    try:
        sub, _ = harness.subscribe(pub, replay=False)
        await pub.wait_subscribed()
        await until(lambda: sub.connected, "connected")
        assert sub.mode_and_reason() == (Mode.DEGRADED, "waiting for the stream's start")
        await pub.publish([blocks(0, 2)])
        await synced(sub, 0)
        assert sub.mode is Mode.EXACT
        await pub.publish([blocks(2, 1, parent=1001)], send=False)
        await pub.publish([blocks(0, 1, medium="CPU")])
        await synced(sub, 2)
        assert sub.mode is Mode.DEGRADED and sub.counts["gap"] == 1
        assert await exact(harness.index) == ExactMatch(0, 1, 4)  # only what came after the gap
    finally:
        await pub.stop()


async def test_a_restart_the_scrape_saw_drops_the_old_state_and_replays_from_zero(
        harness: Harness, publisher: KvEventPublisher) -> None:
    sub, task = harness.subscribe(publisher)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 2)], ts=100.0)
    await synced(sub, 0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    again = KvEventSubscriber(B, M, sub.entry, harness.index, harness.ctx, harness.telemetry)
    harness.tasks.append(asyncio.create_task(again.run(restart_start_s=lambda: 150.0)))
    await synced(again, 0)
    again.on_engine_restart()  # a process started at 150 made none of the state (its origin is 100)
    await until(lambda: publisher.replay_requests.count(0) == 3, "a replay from 0")
    assert (await harness.index.state(M, B)).origin_ts == 100.0  # the replay rebuilt it from the buffer


@pytest.mark.redis
async def test_two_replicas_on_one_redis_apply_each_batch_once(redis_url: str, key_prefix: str,
                                                              publisher: KvEventPublisher) -> None:
    indexes = [RedisEngineIndex.from_url(redis_url, key_prefix=key_prefix, timeout_s=2.0) for _ in range(2)]
    harness = Harness(indexes[0])
    try:
        subs = [harness.subscribe(publisher, index=index)[0] for index in indexes]
        await until(lambda: all(s.mode is Mode.EXACT for s in subs), "both exact")
        for i in range(10):
            await publisher.publish([blocks(i % 8, 1, parent=None if i % 8 == 0 else 999 + i % 8)])
        await until(lambda: all(s.state is not None and s.state.last_seq == 9 for s in subs), "both at seq 9")
        applied = sum(s.counts["applied"] + s.counts["replayed"] for s in subs)
        assert applied == 10 and sum(s.counts["duplicate"] for s in subs) >= 10 - sum(s.counts["gap"] for s in subs)
        assert await exact(indexes[1]) == ExactMatch(8, 0, 4)
    finally:
        await harness.close()
        await drop_keys(indexes[0]._client, key_prefix)
        for index in indexes:
            await index.aclose()


@pytest.mark.redis
async def test_redis_down_degrades_then_catches_up_when_it_is_back(harness: Harness,
                                                                  publisher: KvEventPublisher) -> None:
    port = free_port()
    index = RedisEngineIndex.from_url(f"redis://127.0.0.1:{port}", timeout_s=0.2, apply_timeout_s=0.2)
    server, started = redis_process(port), False
    try:
        sub, task = harness.subscribe(publisher, index=index)
        await publisher.wait_subscribed()
        await until(lambda: sub.connected and not sub.store_ok, "store unavailable")
        await publisher.publish([blocks(0, 2)])
        await until(lambda: sub.counts == dict.fromkeys(sub.counts, 0) and not sub.store_ok, "the batch not applied")
        assert sub.mode_and_reason() == (Mode.DEGRADED, "index store unavailable") and not task.done()
        await asyncio.to_thread(server.__enter__)  # Redis comes up (empty): the catch-up replays from 0
        started = True
        await until(lambda: sub.mode is Mode.EXACT and sub.state is not None, "exact once Redis is back")
        assert await exact(index) == ExactMatch(2, 0, 4)
    finally:
        await index.aclose()
        if started:
            await asyncio.to_thread(server.__exit__, None, None, None)


async def test_a_batch_applied_late_is_lag(harness: Harness, publisher: KvEventPublisher) -> None:
    now = [1000.0]
    sub, _ = harness.subscribe(publisher, wall_clock=lambda: now[0], max_lag_s=5.0)
    await until(lambda: sub.mode is Mode.EXACT, "exact")
    await publisher.wait_subscribed()
    await publisher.publish([blocks(0, 1)], ts=994.0)  # applied 6 s after the engine stamped it
    await synced(sub, 0)
    assert sub.mode_and_reason() == (Mode.DEGRADED, "applying more than 5 s behind the engine")
    await publisher.publish([], ts=999.0)
    await synced(sub, 1)
    assert sub.mode is Mode.EXACT


async def test_an_endpoint_that_is_not_zmq_is_approximate_and_logged(harness: Harness,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    caplog.set_level(logging.WARNING, "kappa_gateway.kv_events")
    try:
        pub = KvEventPublisher(port=port, replay=False)
        sub, task = harness.subscribe(pub, replay=False)
        await until(lambda: f"no publisher at tcp://127.0.0.1:{port}" in caplog.text, "the log line")
        assert sub.mode is Mode.APPROXIMATE and not task.done()
        await pub.stop()
    finally:
        server.close()
        await server.wait_closed()
