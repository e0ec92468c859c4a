"""The mock's KV-event publisher: vLLM's ``ZmqEventPublisher`` on the server's asyncio loop (issue 30).

Wire protocol, as ``vllm/distributed/kv_events.py`` (REFERENCE.md §4):

* PUB socket at ``endpoint`` (bound when it holds ``*``/``::``/``ipc://``/``inproc://``, else
  connected, as vLLM decides; ``bind=True`` forces a bind, which ``mock-fleet`` uses on
  ``tcp://127.0.0.1:PORT``), high-water mark ``hwm``. Each batch is three frames: ``topic``
  (UTF-8), the sequence number as 8 bytes big-endian (0, 1, 2, ... from the publisher's start:
  a restarted engine is a fresh stream), and the msgpack ``KVEventBatch`` (`mock_vllm.kv_event_wire`).
* ROUTER socket at ``replay_endpoint`` (always bound), when given. A request is a REQ socket's
  message ``[8-byte big-endian start_seq]`` (the ROUTER sees ``[identity, b"", start_seq]``;
  anything but 3 frames is ignored, as in vLLM). The reply is, for every buffered batch with
  ``seq >= start_seq`` in order, ``[topic, seq, payload]``, then the end marker
  ``[b"", (-1).to_bytes(8, "big", signed=True), b""]`` (seq all 0xFF, empty topic and payload):
  vLLM's format since vllm-project/vllm#45177 added the topic. The buffer keeps the last
  ``buffer_steps`` batches.

Never blocking the engine: `ZmqEventPublisher.publish` (called by the engine driver after each
step, with the events `mock_vllm.kv_event_recorder` took) assigns the sequence number and queues
the batch, O(1); a sender task on the same loop encodes and sends it while the modelled step runs.
A PUB socket never blocks: a subscriber that reads too slowly loses batches past ``hwm`` inside
ZeroMQ (it sees a gap in the sequence numbers and may replay). At most ``max_queue_size`` batches
wait for the sender; past that a batch is dropped and counted (its sequence number is used, so
the gap shows, but it is not in the replay buffer either). Memory is bounded by ``max_queue_size``
+ ``buffer_steps`` batches here and ``hwm`` per subscriber in ZeroMQ.

Fault knobs (``/kappa/faults/kv_events``, `mock_vllm.kv_event_routes`), for the gateway's tests:

* drop the next N batches: they get their sequence numbers and go into the replay buffer but are
  not sent, so a subscriber sees a gap it can repair by replay;
* reorder the next two batches: the next one is held and sent right after the one that follows;
* stop / start the publisher: stop closes both sockets (subscribers see silence, replay requests
  go unanswered); batches published meanwhile get sequence numbers and are buffered, unsent; start
  binds the same addresses again, so a subscriber that reconnects sees the gap and can replay it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from mock_vllm.kv_event_recorder import KVEventRecorder
from mock_vllm.kv_event_wire import KVEvent, encode_batch
from mock_vllm.kv_events_config import KvEventsConfig

__all__ = ["END_SEQ", "EngineKvEvents", "KvEventsConfig", "ZmqEventPublisher"]

if TYPE_CHECKING:
    from mock_vllm.engine import MockEngine

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay sequence frame
REBIND_TIMEOUT_S = 5.0  # a restarted publisher waits this long for its old ports to be free
REBIND_POLL_S = 0.05


def binds(config: KvEventsConfig) -> bool:
    """vLLM binds its PUB socket when the endpoint has a wildcard (``*``, ``::``) or is ``ipc://`` or
    ``inproc://``, and connects otherwise; ``config.bind`` forces a bind."""
    endpoint = config.endpoint
    return bool(config.bind) or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + ROUTER publisher with a replay buffer and fault knobs (module docstring).

    Args:
        config: an active `KvEventsConfig`.
        data_parallel_rank: the batch's ``data_parallel_rank`` (the mock is one rank: 0).
        clock: wall-clock seconds for each batch's ``ts`` (vLLM: ``time.time()``).

    Use `start` (binds; raises zmq.ZMQError if an address is taken) before `publish`, `close` after.
    """

    def __init__(self, config: KvEventsConfig, *, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._clock = clock
        self._topic = config.topic.encode()
        self._ctx: zmq.Context | None = None  # made by `start`, ended by `close`
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self.endpoint: str | None = None  # the concrete addresses once bound (a ``*`` port resolved)
        self.replay_endpoint: str | None = None
        self._next_seq = 0
        self._queue: deque[tuple[int, float, list[KVEvent]]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._drop_next = 0
        self._reorder_armed = False
        self._held: tuple[int, bytes] | None = None
        self.sent_batches_total = 0
        self.queue_dropped_batches_total = 0  # the sender fell max_queue_size behind
        self.fault_dropped_batches_total = 0  # drop-next-N and stopped: buffered, never sent
        self.replays_served_total = 0

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """The sockets are open (not stopped by the fault knob, not closed)."""
        return self._pub is not None

    async def start(self) -> None:
        """Open the sockets (again, after `stop`, on the same concrete addresses) and the tasks."""
        if self.running:
            return
        deadline = time.monotonic() + REBIND_TIMEOUT_S
        while True:
            try:
                self._open_sockets()
                break
            except zmq.ZMQError as exc:  # a just-closed port can linger in the I/O thread briefly
                self._close_sockets()
                if exc.errno != zmq.EADDRINUSE or self.endpoint is None or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(REBIND_POLL_S)  # poll until the old socket has let go
        if not self._tasks:  # the sender's event belongs to the loop that runs it
            self._wake = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._send_loop(), name="kv-events-sender"))
            if self._queue:
                self._wake.set()
        if self._router is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))

    async def stop(self) -> None:
        """Close both sockets (fault knob); batches still get sequence numbers and are buffered."""
        replay = self._tasks[1:]
        for task in replay:
            task.cancel()
        await asyncio.gather(*replay, return_exceptions=True)
        self._tasks = self._tasks[:1]
        self._close_sockets()

    async def close(self) -> None:
        """Send what is queued, then close the sockets and the ZMQ context."""
        self._drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- publishing -------------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch of events (nothing when empty, as vLLM publishes only non-empty batches).

        Never blocks: past ``max_queue_size`` waiting batches the batch is dropped and counted.
        """
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if len(self._queue) >= self.config.max_queue_size:
            self.queue_dropped_batches_total += 1
            return
        self._queue.append((seq, self._clock(), events))
        self._wake.set()

    def drop_next(self, batches: int) -> None:
        """Fault: the next ``batches`` batches are buffered but not sent (added to any pending)."""
        self._drop_next += batches

    def reorder_next_two(self) -> None:
        """Fault: the next batch is sent after the one that follows it."""
        self._reorder_armed = True

    def clear_faults(self) -> None:
        """No more drops or reordering; a held batch is sent now."""
        self._drop_next, self._reorder_armed = 0, False
        held, self._held = self._held, None
        if held is not None:
            self._send(*held)

    def state(self) -> dict[str, Any]:
        """Counters and knobs, for ``GET /kappa/faults/kv_events``."""
        return {"running": self.running, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.config.topic, "encoding": self.config.encoding, "next_seq": self._next_seq,
                "drop_next_batches": self._drop_next, "reorder_armed": self._reorder_armed,
                "held_seq": None if self._held is None else self._held[0],
                "buffered_seqs": [self._buffer[0][0], self._buffer[-1][0]] if self._buffer else None,
                "queued_batches": len(self._queue), "sent_batches_total": self.sent_batches_total,
                "queue_dropped_batches_total": self.queue_dropped_batches_total,
                "fault_dropped_batches_total": self.fault_dropped_batches_total,
                "replays_served_total": self.replays_served_total}

    # -- internals --------------------------------------------------------------------------
    def _open_sockets(self) -> None:
        config = self.config
        ctx = self._ctx = self._ctx or zmq.Context()
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(config.hwm)
        endpoint = self.endpoint or config.endpoint  # after a stop, the address first bound (a ``*`` port resolved)
        if binds(config):
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:  # vLLM connects to an address without a wildcard (a central proxy binds it)
            pub.connect(endpoint)
            self.endpoint = endpoint
        if config.replay_endpoint is not None:
            router = self._router = zmq.asyncio.Socket(ctx, zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint or config.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        encoding = self.config.encoding
        while self._queue:
            seq, ts, events = self._queue.popleft()
            payload = encode_batch(ts, events, encoding, self._rank)
            self._buffer.append((seq, payload))
            self._emit(seq, payload)

    def _emit(self, seq: int, payload: bytes) -> None:
        if self._drop_next > 0 or not self.running:  # dropped by the knob, or the sockets are stopped
            self._drop_next -= self._drop_next > 0
            self.fault_dropped_batches_total += 1
            return
        if self._reorder_armed:
            if self._held is None:
                self._held = (seq, payload)
                return
            held, self._held, self._reorder_armed = self._held, None, False
            self._send(seq, payload)
            self._send(*held)
            return
        self._send(seq, payload)

    def _send(self, seq: int, payload: bytes) -> None:
        if self._pub is None:
            self.fault_dropped_batches_total += 1
            return
        try:  # a PUB socket drops past its high-water mark instead of blocking
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent_batches_total += 1
        except zmq.Again:
            self.fault_dropped_batches_total += 1

    async def _replay_loop(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:  # vLLM ignores anything but [identity, b"", start_seq]
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # A ROUTER drops what a peer cannot take (past its high-water mark) rather than block.
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart((identity, b"", b"", END_SEQ, b""))
            self.replays_served_total += 1


class EngineKvEvents:
    """An engine's KV events as the server runs them: the recorder inside the engine, the publisher outside.

    Args:
        engine: the engine, with no request yet; its events are recorded from now on.
        config: an active `KvEventsConfig`.
    """

    def __init__(self, engine: MockEngine, config: KvEventsConfig) -> None:
        self.recorder = KVEventRecorder(engine.block_size, config.python_hash_seed)
        engine.enable_kv_events(self.recorder)
        self.publisher = ZmqEventPublisher(config)
        self._cache = engine.cache

    def flush(self) -> None:
        """Publish what the engine recorded since the last flush as one batch (after each step, and
        after a cache reset, so that ``AllBlocksCleared`` goes out at once even when the engine is idle)."""
        self.publisher.publish(self.recorder.take())

    def resident_blocks(self) -> dict[str, list[int] | int]:
        """The engine's cache as vLLM's events name it, for ``GET /kappa/kv_events/blocks``: ``{"GPU": [...],
        "CPU": [...]}`` the published hashes (unsigned 64-bit ints, sorted) of the cached blocks resident in
        HBM and in the host tier now, and ``"unnamed"``: resident blocks no event named (0 unless the engine
        cached blocks before its events were enabled). A subscriber that applied every batch up to
        ``next_seq - 1`` holds exactly these."""
        hbm, host = self._cache.resident_hashes()
        out: dict[str, list[int] | int] = {"unnamed": 0}
        for medium, hashes in (("GPU", hbm), ("CPU", host)):
            names = [self.recorder.external_hash(h) for h in hashes]
            out[medium] = sorted(n for n in names if n is not None)
            out["unnamed"] += names.count(None)  # type: ignore[operator]
        return out
