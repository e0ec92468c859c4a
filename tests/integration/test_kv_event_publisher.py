"""The KV-event publisher alone, on a real PUB socket on 127.0.0.1: a subscriber that never reads must
not slow the engine down or grow memory, and a sender that falls behind drops batches, counted.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq

from mock_vllm.kv_event_wire import BlockStored
from mock_vllm.kv_events import KvEventsConfig, ZmqEventPublisher

pytestmark = pytest.mark.integration

HWM = 10
BUFFER_STEPS = 50
BATCHES = 2_000
TOKENS_PER_BATCH = 4_000  # ~12 KB a batch: 2,000 of them overflow any loopback socket buffer
PUBLISH_BUDGET_S = 0.05  # one publish() call may take at most this (it only queues; slack for a loaded machine)
DEADLINE_S = 10.0


def batch(i: int) -> list[BlockStored]:
    return [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=list(range(100_000, 100_000 + TOKENS_PER_BATCH)),
                        block_size=16, medium="GPU")]


async def publish_to_a_subscriber_that_never_reads(sub: zmq.Socket) -> tuple[ZmqEventPublisher, float]:
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                                 buffer_steps=BUFFER_STEPS, hwm=HWM))
    await publisher.start()
    sub.connect(publisher.endpoint)
    slowest = 0.0
    try:
        for i in range(BATCHES):
            start = time.perf_counter()
            publisher.publish(batch(i))
            slowest = max(slowest, time.perf_counter() - start)
            await asyncio.sleep(0)  # the engine's step: the sender task runs meanwhile
        deadline = time.monotonic() + DEADLINE_S
        while publisher.state()["queued_batches"]:
            assert time.monotonic() < deadline, "the sender never caught up"
            await asyncio.sleep(0.01)  # poll interval while the sender drains
    finally:
        await publisher.close()
    return publisher, slowest


def test_a_subscriber_that_never_reads_neither_blocks_nor_grows_memory() -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, HWM)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        publisher, slowest = asyncio.run(publish_to_a_subscriber_that_never_reads(sub))
        state = publisher.state()
        assert slowest < PUBLISH_BUDGET_S
        assert state["next_seq"] == state["sent_batches_total"] == BATCHES  # every send returned at once
        assert state["buffered_seqs"] == [BATCHES - BUFFER_STEPS, BATCHES - 1]  # the replay buffer is bounded
        received = []
        while sub.poll(200):  # what ZeroMQ kept for the slow subscriber: at most its high-water marks' worth
            _, seq, payload = sub.recv_multipart()
            received.append(int.from_bytes(seq, "big"))
            assert msgpack.unpackb(payload, raw=False)[1][0]["block_hashes"] == [received[-1]]
        assert 0 < len(received) < BATCHES // 2
        assert received == sorted(received) and received[-1] - received[0] + 1 > len(received)  # a gap shows
    finally:
        sub.close()
        ctx.term()


async def outrun_the_sender() -> ZmqEventPublisher:
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                                 max_queue_size=10))
    await publisher.start()
    try:
        for i in range(100):  # no await between: the sender task cannot run
            publisher.publish(batch(i))
        assert publisher.state()["queued_batches"] == 10
    finally:
        await publisher.close()
    return publisher


def test_batches_past_max_queue_size_are_dropped_and_counted_with_their_seqs_used() -> None:
    state = asyncio.run(outrun_the_sender()).state()
    assert (state["queue_dropped_batches_total"], state["next_seq"], state["buffered_seqs"]) == (90, 100, [0, 9])


def test_empty_batches_are_not_published() -> None:
    async def run() -> dict:
        publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))
        await publisher.start()
        publisher.publish([])
        await publisher.close()
        return publisher.state()

    assert asyncio.run(run())["next_seq"] == 0
