"""A test publisher of KV-cache events that follows vLLM's protocol (imports none of our packages).

As ``vllm/distributed/kv_events.py::ZmqEventPublisher``: a PUB socket sends ``(topic, seq as 8
bytes BE, payload)`` with seq counting from 0, every sent batch is kept in a replay buffer, and a
ROUTER socket answers a request ``[identity, b"", start_seq]`` with ``[identity, b"", seq, payload]``
for each buffered batch from ``start_seq`` on, then ``[identity, b"", -1 (8 signed bytes), b""]``.
The PUB side is an XPUB (the same wire to a SUB) so a test can wait until a subscriber's
subscription has arrived instead of sleeping. Faults are explicit: ``publish(send=False)`` buffers
a batch without sending it (a drop), `resend` sends a buffered batch again (late or reordered),
`send_raw` sends any frames.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from tests.support.kv_events_wire import REPLAY_END, batch, seq_frame


class KvEventPublisher:
    """Bind with `start` (ports chosen on 127.0.0.1 unless given), `stop` to unbind."""

    def __init__(self, *, port: int | None = None, replay_port: int | None = None, topic: str = "",
                 replay: bool = True, buffer_steps: int = 10_000, batch_form: str = "array") -> None:
        self.port, self.replay_port, self.topic = port, replay_port, topic.encode()
        self.with_replay, self.batch_form = replay, batch_form
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self._ctx = zmq.asyncio.Context()
        self._subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def start(self) -> KvEventPublisher:
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.linger = 0
        self.port = _bind(self._pub, self.port)
        self._tasks.append(asyncio.create_task(self._watch_subscriptions()))
        if self.with_replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.linger = 0
            self.replay_port = _bind(self._router, self.replay_port)
            self._tasks.append(asyncio.create_task(self._serve_replay()))
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)

    async def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Until some subscriber's subscription reached the publisher."""
        await asyncio.wait_for(self._subscribed.wait(), timeout_s)

    async def publish(self, events: list[Any], *, ts: float | None = None, send: bool = True) -> int:
        """Buffer the next batch and (unless ``send`` is False) send it; returns its seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = batch(time.time() if ts is None else ts, events, batch_form=self.batch_form)
        self.buffer.append((seq, payload))
        if send:
            await self._pub.send_multipart([self.topic, seq_frame(seq), payload])
        return seq

    async def resend(self, seq: int) -> None:
        payload = next(p for s, p in self.buffer if s == seq)
        await self._pub.send_multipart([self.topic, seq_frame(seq), payload])

    async def send_raw(self, frames: list[bytes], *, buffer_seq: int | None = None) -> None:
        """Send ``frames`` as they are; with ``buffer_seq``, also buffer ``frames[2]`` under it (and
        advance the counter past it), as a publisher that sent a bad payload would replay it."""
        if buffer_seq is not None:
            self.buffer.append((buffer_seq, frames[2]))
            self.next_seq = buffer_seq + 1
        await self._pub.send_multipart(frames)

    async def _watch_subscriptions(self) -> None:
        while True:
            frame = await self._pub.recv()
            if frame[:1] == b"\x01":
                self._subscribed.set()

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart([client, b"", seq_frame(seq), payload])
            await self._router.send_multipart([client, b"", REPLAY_END, b""])


def _bind(socket: zmq.asyncio.Socket, port: int | None) -> int:
    if port is None:
        return socket.bind_to_random_port("tcp://127.0.0.1")
    socket.bind(f"tcp://127.0.0.1:{port}")
    return port


class PublisherThread:
    """A `KvEventPublisher` on its own event loop in a daemon thread, for synchronous tests (a gateway
    served in another thread): `call` runs one of its coroutine methods there and waits for it."""

    def __init__(self, **options: Any) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self.publisher: KvEventPublisher = self.call(KvEventPublisher(**options).start())

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def publish(self, events: list[Any], **kw: Any) -> int:
        return self.call(self.publisher.publish(events, **kw))

    def close(self) -> None:
        self.call(self.publisher.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
