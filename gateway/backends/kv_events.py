"""One backend's KV-event subscriber: vLLM's ZMQ stream into the exact index, with a mode.

vLLM publishes ``(topic, seq, msgpack EventBatch)`` on a PUB socket and replays missed batches
from a ROUTER socket (``vllm/distributed/kv_events.py``; `prefix_index.engine_events`,
`gateway.backends.kv_replay`). The subscriber is a ``zmq.asyncio`` SUB connected to the
backend's ``kv_events.endpoint`` with its ``topic`` as the filter; it decodes each batch and
hands it to the shared exact index (`prefix_index.engine_index.EngineIndex.apply`), which applies
it once across every subscriber of every replica.

Repairs. A ``gap`` (batches missed: a drop, a slow joiner, a Redis outage) is repaired by a replay
from the index's ``last_seq + 1``, applied in order; so is the catch-up on each (re)connection.
When there is no replay endpoint, it fails, or its buffer no longer reaches back, the backend's
entries are dropped and the stream is taken up where it is (``mid_stream_ok``): a partial state.
A new stream (the engine restarted: seq back, later ``ts``) is detected by the index; a restart
the scrape sees (``process_start_time_seconds`` changed) drops the state made before it
(`on_engine_restart`) and replays from 0. A batch that does not decode is counted ``malformed``
and skipped: its sequence number is applied as lost (the state stops being clean).

Modes (`Mode`), in this order of precedence:

- ``approximate``: no ZMQ handshake with the publisher (down, unreachable, not a ZMQ PUB); one
  log line when it is first missed, then ZMQ reconnects on its own, backing off from 0.1 s to
  30 s (``RECONNECT_IVL``/``RECONNECT_IVL_MAX``). Routing uses the approximate index.
- ``degraded``: connected, but a replay is in progress, the index store is failing (asked again
  every ``STORE_RETRY_S`` while no batch comes, then caught up by a replay), the last
  batch was applied more than ``max_lag_s`` after the engine published it, or the state is not
  clean (a mid-stream start, a lost batch, blocks refused at the cap). Routing: approximate.
- ``exact``: connected and none of the above — the state began at the engine's seq 0 or an
  ``AllBlocksCleared`` (or a replay from 0 found the engine had published nothing) and nothing
  was lost since. It returns to ``exact`` from a partial state only at such a clean point: the
  engine's next ``AllBlocksCleared``, a new stream (restart), or a replay from seq 0 after a
  restart the scrape saw. Routing uses the exact entries.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from fleet_config.kv_events import KvEventsEntry
from gateway.backends.kv_replay import ReplayFailed, replay
from gateway.telemetry.kv_events import KvEventsTelemetry
from prefix_index import PrefixIndexError
from prefix_index.engine_events import EventBatch, MalformedEvents, decode_batch, decode_seq
from prefix_index.engine_index import ApplyOutcome, ApplyResult, EngineIndex, EngineState

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_MAX_LAG_S", "DEFAULT_REPLAY_TIMEOUT_S", "KvEventSubscriber", "Mode"]

log = logging.getLogger("kappa_gateway.kv_events")

# No handshake this long after connecting: the line saying the endpoint is down (ZMQ keeps trying).
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# The longest wait for each replayed message; vLLM answers from memory, in milliseconds.
DEFAULT_REPLAY_TIMEOUT_S = 2.0
# A batch applied this long after the engine stamped it (its ts, the engine's wall clock) means the
# subscriber is behind: 5 s is ~100 engine steps, far past one scrape interval.
DEFAULT_MAX_LAG_S = 5.0
RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 100, 30_000
# While the index store fails and no batch arrives (an idle engine), it is asked again this often.
STORE_RETRY_S = 1.0
_POLL_MS = 250
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class Mode(enum.Enum):
    EXACT = "exact"
    DEGRADED = "degraded"
    APPROXIMATE = "approximate"


class KvEventSubscriber:
    """Subscribes to one backend's KV events and keeps its exact-index state; `run` until cancelled.

    Args:
        backend_id, model: the backend and the model its engine serves (the events name neither).
        entry: its ``kv_events`` config (endpoint, replay endpoint, topic).
        index: the shared exact index.
        context: the gateway's ``zmq.asyncio`` context.
        telemetry: where modes and counts go.
        wall_clock: seconds since the epoch (for lag against the engine's ``ts``).
    """

    def __init__(self, backend_id: str, model: str, entry: KvEventsEntry, index: EngineIndex,
                 context: zmq.asyncio.Context, telemetry: KvEventsTelemetry, *,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S, max_lag_s: float = DEFAULT_MAX_LAG_S,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.backend_id, self.model, self.entry = backend_id, model, entry
        self._index, self._context, self._telemetry = index, context, telemetry
        self._connect_timeout_s, self._replay_timeout_s, self._max_lag_s = connect_timeout_s, replay_timeout_s, max_lag_s
        self._wall_clock = wall_clock
        self.connected = False
        self.replaying = False
        self.store_ok = True
        self.lagging = False
        self.synced_empty = False  # a replay from 0 found nothing published: the empty state is complete
        self.behind = False  # a catch-up replay failed: what was published while away is unknown
        self.state: EngineState | None = None
        self.counts = dict.fromkeys(KvEventsTelemetry.OUTCOMES, 0)
        self.stream_restarts = 0
        self.not_connected_reason = "not started"
        self._resync = asyncio.Event()
        self._telemetry.set_mode(backend_id, Mode.APPROXIMATE.value)

    @property
    def mode(self) -> Mode:
        return self.mode_and_reason()[0]

    def mode_and_reason(self) -> tuple[Mode, str]:
        """The mode (module docstring) and why, in a few words."""
        if not self.connected:
            return Mode.APPROXIMATE, self.not_connected_reason
        for flag, reason in ((self.replaying, "replay in progress"), (not self.store_ok, "index store unavailable"),
                             (self.lagging, f"applying more than {self._max_lag_s:g} s behind the engine"),
                             (self.behind, "catch-up replay failed: waiting for the next batch")):
            if flag:
                return Mode.DEGRADED, reason
        if self.state is None:
            return (Mode.EXACT, "empty engine") if self.synced_empty else (Mode.DEGRADED, "waiting for the stream's start")
        if not self.state.clean:
            return Mode.DEGRADED, "partial state (mid-stream start, lost batch or cap): waiting for a clean point"
        return Mode.EXACT, "in sync"

    def on_engine_restart(self) -> None:
        """The scrape saw a new process: resync (`run` drops state older than the process, replays from 0)."""
        self._resync.set()

    async def run(self, *, restart_start_s: Callable[[], float | None] = lambda: None) -> None:
        """Subscribe until cancelled; a ZMQ error (a bad address) is logged and retried with backoff.

        Args:
            restart_start_s: the backend's latest ``process_start_time_seconds`` (for `on_engine_restart`).
        """
        self._restart_start_s = restart_start_s
        backoff_s = RECONNECT_IVL_MS / 1000
        while True:
            try:
                await self._session()
            except zmq.ZMQError as exc:
                self._set_connected(False, f"cannot connect to {self.entry.endpoint}: {exc}")
                log.warning("KV events of backend %s: cannot connect to %s (%s): routing it approximately; "
                            "retrying in %.1f s", self.backend_id, self.entry.endpoint, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, RECONNECT_IVL_MAX_MS / 1000)

    async def _session(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.entry.topic.encode())
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        try:
            sub.connect(self.entry.endpoint)
            self._set_connected(False, f"no ZMQ handshake with {self.entry.endpoint} yet")
            await self._consume(sub, monitor)
        finally:
            self._set_connected(False, "subscriber stopped")
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _consume(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        warn_at = asyncio.get_running_loop().time() + self._connect_timeout_s
        warned = False
        retry_at = 0.0
        while True:
            ready = dict(await poller.poll(_POLL_MS))
            if monitor in ready:
                await self._on_monitor(await recv_monitor_message(monitor))
            if sub in ready:
                for _ in range(1000):  # what is queued, then the monitor and resync get a turn
                    try:
                        frames = await sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._on_message(frames)
            if self._resync.is_set() and self.connected:
                self._resync.clear()
                await self._engine_restarted()
            now = asyncio.get_running_loop().time()
            if self.connected and not self.store_ok and now >= retry_at:  # catch up once the store is back
                retry_at = now + STORE_RETRY_S
                await self._catch_up()
            if not self.connected and not warned and asyncio.get_running_loop().time() >= warn_at:
                warned = True
                log.warning("KV events of backend %s: no publisher at %s (no ZMQ handshake within %g s): routing it "
                            "approximately; ZMQ keeps retrying (every %g-%g s)", self.backend_id, self.entry.endpoint,
                            self._connect_timeout_s, RECONNECT_IVL_MS / 1000, RECONNECT_IVL_MAX_MS / 1000)
            if self.connected:
                warned = False

    async def _on_monitor(self, message: dict[str, Any]) -> None:
        if message["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_connected(True, "")
            log.info("KV events of backend %s: subscribed to %s", self.backend_id, self.entry.endpoint)
            await self._catch_up()
        elif message["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.connected:
            self._set_connected(False, f"publisher at {self.entry.endpoint} disconnected")
            log.warning("KV events of backend %s: publisher at %s disconnected: routing it approximately until "
                        "it is back", self.backend_id, self.entry.endpoint)

    def _set_connected(self, connected: bool, reason: str) -> None:
        self.connected = connected
        if not connected:
            self.not_connected_reason = reason
        self._publish_mode()

    def _publish_mode(self) -> None:
        self._telemetry.set_mode(self.backend_id, self.mode.value)

    async def _catch_up(self) -> None:
        """After a (re)connection: replay whatever the index lacks (from its ``last_seq + 1``, or 0)."""
        try:
            self.state = await self._index.state(self.model, self.backend_id)
            if not self.store_ok:
                log.info("KV events of backend %s: the index store answers again", self.backend_id)
            self.store_ok = True
        except PrefixIndexError as exc:
            self._store_failed(exc)
            return
        if self.entry.replay_endpoint is None:
            return self._publish_mode()
        if self.state is None:
            await self._replay_from(0, trigger=None)
            return
        # From the last seq the index has, not the next: the same stream answers with it (a duplicate), a
        # new stream longer than ours with a later ts (the index sees the restart), a shorter one with nothing.
        last = self.state
        if await self._replay_from(last.last_seq, trigger=None, expect_first=True) is None:
            log.warning("KV events of backend %s: the publisher has no batch %d any more: a new event stream (the "
                        "engine restarted); dropping the old entries", self.backend_id, last.last_seq)
            try:
                await self._index.clear(self.model, self.backend_id,
                                        origin_before_ts=math.nextafter(last.last_ts, math.inf))
            except PrefixIndexError as exc:
                return self._store_failed(exc)
            self.state = None
            self.stream_restarts += 1
            await self._replay_from(0, trigger=None)

    async def _engine_restarted(self) -> None:
        """A restart the scrape saw: drop the state older than the new process, then catch up."""
        try:
            await self._index.clear(self.model, self.backend_id, origin_before_ts=self._restart_start_s())
        except PrefixIndexError as exc:
            self._store_failed(exc)
            return
        self.synced_empty = False
        await self._catch_up()

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._count("malformed")
            log.warning("KV events of backend %s: a message of %d frames (expected topic, seq, payload): skipped",
                        self.backend_id, len(frames))
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedEvents as exc:
            self._count("malformed")
            log.warning("KV events of backend %s: %s: skipped", self.backend_id, exc)
            return
        result = await self._apply(seq, frames[2], replayed=False)
        if result is not None and result.outcome is ApplyOutcome.GAP:
            await self._repair(result, seq, frames[2])

    async def _apply(self, seq: int, payload: bytes, *, replayed: bool, mid_stream_ok: bool = False
                     ) -> ApplyResult | None:
        """Decode and apply one batch; counts and state follow. None when the index store failed."""
        lost = False
        try:
            batch = decode_batch(payload)
        except MalformedEvents as exc:
            self._count("malformed")
            log.warning("KV events of backend %s: batch %d does not decode (%s): skipped, state marked partial",
                        self.backend_id, seq, exc)
            batch, lost = EventBatch(self.state.last_ts if self.state else 0.0, ()), True
        try:
            result = await self._index.apply(self.model, self.backend_id, seq, batch, mid_stream_ok=mid_stream_ok,
                                             lost=lost)
        except PrefixIndexError as exc:
            self._store_failed(exc)
            return None
        if not self.store_ok:
            log.info("KV events of backend %s: the index store answers again", self.backend_id)
        self.store_ok = True
        self._take(result, batch, replayed=replayed)
        return result

    def _take(self, result: ApplyResult, batch: EventBatch, *, replayed: bool) -> None:
        outcome = result.outcome
        if outcome is not ApplyOutcome.APPLIED or not replayed:
            self._count(outcome.value)
        else:
            self._count("replayed")
        if result.restarted:
            self.stream_restarts += 1
            log.warning("KV events of backend %s: a new event stream (the engine restarted): its old entries dropped",
                        self.backend_id)
        if result.state is not None or result.restarted:
            self.state = result.state
            self.synced_empty = False
        if result.state is not None:
            self._telemetry.set_blocks(self.backend_id, result.state.blocks)
        if outcome is not ApplyOutcome.GAP:
            self.behind = False  # the index holds every batch up to this one: in sequence again
        if outcome is ApplyOutcome.APPLIED and not replayed:
            self.lagging = self._wall_clock() - batch.ts > self._max_lag_s
        self._publish_mode()

    async def _repair(self, gap: ApplyResult, seq: int, payload: bytes) -> None:
        """Replay from the index's next seq; without a covering replay, drop and take up mid-stream."""
        from_seq = 0 if gap.state is None else gap.state.last_seq + 1
        if self.entry.replay_endpoint is not None and await self._replay_from(from_seq, trigger=seq):
            return
        log.warning("KV events of backend %s: batches from %d on are lost (%s): dropping its entries; partial "
                    "state until a clean point", self.backend_id, from_seq,
                    "no replay endpoint" if self.entry.replay_endpoint is None else "the replay did not cover them")
        try:
            await self._index.clear(self.model, self.backend_id)
        except PrefixIndexError as exc:
            self._store_failed(exc)
            return
        await self._apply(seq, payload, replayed=False, mid_stream_ok=True)

    async def _replay_from(self, from_seq: int, *, trigger: int | None, expect_first: bool = False) -> bool | None:
        """Replay and apply from ``from_seq``. False when the replay failed or starts later than
        ``from_seq`` while a ``trigger`` batch is waiting (the caller then drops and goes on); None,
        applying nothing, when ``expect_first`` and the answer is empty (the publisher lacks ``from_seq``)."""
        self.replaying = True
        self._publish_mode()
        try:
            assert self.entry.replay_endpoint is not None
            batches = await replay(self._context, self.entry.replay_endpoint, from_seq, timeout_s=self._replay_timeout_s)
        except ReplayFailed as exc:
            log.warning("KV events of backend %s: replay from %d failed: %s", self.backend_id, from_seq, exc)
            self.behind = trigger is None  # a catch-up: whether batches were missed is unknown
            return False
        finally:
            self.replaying = False
        if expect_first and not batches:
            return None
        if batches and batches[0][0] > from_seq:
            if trigger is not None:
                return False
            try:  # a catch-up that cannot be whole: what the index has is partial now
                await self._index.clear(self.model, self.backend_id)
            except PrefixIndexError as exc:
                self._store_failed(exc)
                return False
        elif not batches and from_seq == 0:
            self.synced_empty = True
        for i, (seq, payload) in enumerate(batches):
            await self._apply(seq, payload, replayed=True, mid_stream_ok=i == 0 and seq > from_seq)
        self._publish_mode()
        return True

    def _store_failed(self, exc: PrefixIndexError) -> None:
        if self.store_ok:
            log.warning("KV events of backend %s: the index store failed (%s): degraded until it answers",
                        self.backend_id, exc)
        self.store_ok = False
        self._publish_mode()

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self._telemetry.count(self.backend_id, outcome)
