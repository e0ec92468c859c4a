"""Coalescing of the Redis index's request-path calls: one EVALSHA per model per loop turn.

At concurrency, a gateway issues a ``match`` for every arriving request and a ``record``
for every request whose prefill started. Sent one by one, each costs a redis-py command
(packing, a socket write, a read, parsing, in the gateway's CPU) and a Redis command
dispatch. :class:`Coalescer` queues the calls of one event-loop turn and sends
them, per model, as one ``redis_lua.BATCH_LUA`` call at the end of the turn
(``loop.call_soon``: no added wait) — records first, then matches, so a match sees every
record sent with or before it.

Matches are on the request path and never wait. Records are not: one batch carrying
records is in flight per model at a time, holding at most ``RECORD_BLOCKS_PER_BATCH``
blocks (a Lua script blocks Redis while it runs, so a huge one would stall the matches
behind it); records made meanwhile wait, and the ones whose callers gave up before they
were sent (their deadline passed) are dropped, so an overloaded Redis is not handed work
nobody waits for. A match therefore sees every record that completed before it was
issued, and maybe later ones.

A batch can also carry a `Rider` (`Coalescer.carry`): the gateway replicas' load exchange
(`gateway.replicas.peer_load`) then goes at the end of the turn's first batch, in the same
EVALSHA, instead of as a command of its own (single Redis only).

A batch that fails (`redis_errors.map_redis_errors`) fails each of its calls with its own
``IndexUnavailable``; one aborted (cancelled at shutdown) fails them too, so no caller waits
forever.

It is the DataLoader pattern (batch the loads issued in one tick); it plays the role of
the pipelining LiteLLM's users asked for when per-request Redis round trips dominated
under load (BerriAI/litellm#6483).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.client import Redis
from redis.asyncio.cluster import RedisCluster

from prefix_index.base import BlockMatch, TierCapacity
from prefix_index.deadline import Deadline
from prefix_index.errors import IndexUnavailable
from prefix_index.redis_errors import map_redis_errors
from prefix_index.redis_lua import BATCH_LUA, match_spec_struct
from prefix_index.redis_registry import Registry

__all__ = ["RECORD_BLOCKS_PER_BATCH", "Coalescer", "Rider"]

# Blocks recorded per script call, at most (one record may exceed it alone): ZADD of 8,192
# members takes Redis ~4 ms on this machine, the longest a match may wait behind it.
RECORD_BLOCKS_PER_BATCH = 8192


@dataclass(slots=True)
class _Record:
    future: asyncio.Future
    blocks_key: str
    total_blocks: int
    packed: bytes
    registration: tuple[str, str]  # (registry key, model), for the registry


@dataclass(slots=True)
class _Match:
    future: asyncio.Future
    blocks_keys: dict[str, str]  # backend id -> key
    capacities: Mapping[str, TierCapacity]
    packed: bytes


@dataclass(slots=True)
class Rider:
    """A lease-hash exchange that rides in a batch (`Coalescer.carry`; ``redis_lua.BATCH_LUA``).

    Attributes:
        own_key: the hash written: ``HSET own_key *fields`` then ``PEXPIRE own_key lease_ms``
            (neither when ``fields`` is empty).
        fields: field, value, field, value, ... (strings).
        lease_ms: the own hash's expiry, in milliseconds.
        read_keys: the hashes read, each with HGETALL, after the write.
        future: resolves to the HGETALL replies (flat field, value lists, empty for a missing
            key), in ``read_keys``' order, or fails with ``IndexUnavailable`` as the batch does.
    """

    own_key: str
    fields: list[str]
    lease_ms: int
    read_keys: list[str]
    future: asyncio.Future


@dataclass(slots=True)
class _Batch:
    """The calls queued for one model."""

    records: list[_Record] = field(default_factory=list)
    matches: list[_Match] = field(default_factory=list)
    rider: Rider | None = None


class Coalescer:
    """Queues records and matches and sends each model's batch as one EVALSHA.

    Args:
        client: the index's ``redis.asyncio.Redis`` or ``RedisCluster``.
        timeout_s: deadline of one batch, in seconds (a `deadline.Deadline`: the event
            loop's stalls do not count); past it every call in the batch fails with
            ``IndexUnavailable``.
        key_ttl_s: expiry the script sets on every key a record writes, seconds (>= 1).
        registry: the backends' registry sets; written (before the record's caller
            resumes) for each record that created its blocks key or whose entry is due
            for a refresh (`redis_registry.Registry.due`).
    """

    def __init__(self, client: Redis | RedisCluster, timeout_s: float, key_ttl_s: int, registry: Registry) -> None:
        self._cluster = isinstance(client, RedisCluster)
        self._rider_source: Callable[[], Rider | None] | None = None
        self._script = client.register_script(BATCH_LUA)
        self._timeout_s = timeout_s
        self._key_ttl_s = key_ttl_s
        self._registry = registry
        self._pending: dict[str, _Batch] = {}  # clock key -> calls not sent yet
        self._busy: set[str] = set()  # clock keys with a batch carrying records in flight
        self._flush_scheduled = False
        self._in_flight: set[asyncio.Task] = set()
        self.batches_sent = 0  # for tests and benchmarks: how much coalescing happened
        self.calls_sent = 0
        self.calls_abandoned = 0  # queued calls whose caller had given up before sending

    def record(self, clock_key: str, blocks_key: str, packed: bytes, capacity: TierCapacity,
               registration: tuple[str, str]) -> asyncio.Future:
        """Queue a record; the future resolves to None once Redis has it.
        ``registration`` is (registry key, model), for the registry."""
        future = asyncio.get_running_loop().create_future()
        self._queue(clock_key).records.append(_Record(future, blocks_key, capacity.total_blocks, packed, registration))
        return future

    def match(self, clock_key: str, blocks_keys: dict[str, str], packed: bytes,
              capacities: Mapping[str, TierCapacity]) -> asyncio.Future:
        """Queue a match (``blocks_keys``: backend id -> key); the future resolves to
        backend id -> ``BlockMatch``."""
        future = asyncio.get_running_loop().create_future()
        self._queue(clock_key).matches.append(_Match(future, blocks_keys, capacities, packed))
        return future

    def carry(self, source: Callable[[], Rider | None]) -> bool:
        """From now on, ask ``source`` for a `Rider` whenever a batch is sent, and send the one
        it returns (if any) at the end of that batch: its write and reads cost no command of
        their own. The first batch of each loop turn's flush asks. Only on a single Redis
        (returns False and does nothing on a Redis Cluster, where the rider's keys are in
        another slot than a model's)."""
        if self._cluster:
            return False
        self._rider_source = source
        return True

    async def aclose(self) -> None:
        """Wait for the batches in flight (each bounded by the timeout)."""
        while self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    def _queue(self, clock_key: str) -> _Batch:
        batch = self._pending.get(clock_key)
        if batch is None:
            batch = self._pending[clock_key] = _Batch()
        self._schedule_flush()
        return batch

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        loop = asyncio.get_running_loop()
        rider_asked = False
        for clock_key in list(self._pending):
            waiting = self._pending[clock_key]
            batch = _Batch(matches=waiting.matches)
            waiting.matches = []
            if clock_key not in self._busy:
                live = [r for r in waiting.records if not r.future.done()]
                self.calls_abandoned += len(waiting.records) - len(live)
                taken = blocks = 0
                for r in live:
                    if taken and blocks + len(r.packed) // 8 > RECORD_BLOCKS_PER_BATCH:
                        break
                    blocks += len(r.packed) // 8
                    taken += 1
                batch.records, waiting.records = live[:taken], live[taken:]
            if not waiting.records:
                del self._pending[clock_key]
            if not batch.records and not batch.matches:
                continue
            if batch.records:
                self._busy.add(clock_key)
            if self._rider_source is not None and not rider_asked:
                rider_asked = True
                batch.rider = self._rider_source()
            task = loop.create_task(self._send(clock_key, batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(self, clock_key: str, batch: _Batch) -> None:
        try:
            await self._run(clock_key, batch)
        finally:
            if batch.records:
                self._busy.discard(clock_key)
                if clock_key in self._pending:
                    self._schedule_flush()

    async def _run(self, clock_key: str, batch: _Batch) -> None:
        records = [r for r in batch.records if not r.future.done()]
        matches = [m for m in batch.matches if not m.future.done()]
        self.calls_abandoned += len(batch.records) + len(batch.matches) - len(records) - len(matches)
        rider = batch.rider
        if not records and not matches and rider is None:
            return
        keys, args = self._script_call(clock_key, records, matches, rider)
        self.batches_sent += 1
        self.calls_sent += len(records) + len(matches)
        calls: list[_Record | _Match | Rider] = [*records, *matches]
        if rider is not None:
            calls.append(rider)
        ops = "+".join(op for op, queued in (("record", records), ("match", matches), ("rider", rider)) if queued)
        try:
            with map_redis_errors(ops, self._timeout_s):
                async with Deadline(self._timeout_s):
                    flat = await self._script(keys=keys, args=args)
                    due = [r.registration for r, existed in zip(records, flat)
                           if self._registry.due(r.registration, not existed)]
                    if due:
                        await self._registry.add(due)
        except IndexUnavailable as exc:
            for call in calls:
                if not call.future.done():
                    error = IndexUnavailable(str(exc))  # one instance per caller: each raises its own
                    error.__cause__ = exc.__cause__
                    call.future.set_exception(error)
            return
        except BaseException as exc:  # cancelled at shutdown, or a bug: no caller waits forever
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(IndexUnavailable(f"redis batch aborted: {exc!r}"))
            raise
        _settle(records, matches, rider, flat)

    def _script_call(self, clock_key: str, records: list[_Record], matches: list[_Match],
                     rider: Rider | None) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of ``redis_lua.BATCH_LUA`` for these calls (its header states the layout)."""
        key_ids: dict[str, int] = {}  # blocks key -> KEYS index (KEYS[1] is the clock)

        def key_id(key: str) -> int:
            index = key_ids.get(key)
            if index is None:
                index = key_ids[key] = len(key_ids) + 2
            return index

        args: list[Any] = [len(records), len(matches), self._key_ttl_s, 0, 0]
        for r in records:
            args += (key_id(r.blocks_key), r.total_blocks, r.packed)
        for m in matches:
            spec: list[int] = []
            for backend_id, key in m.blocks_keys.items():
                capacity = m.capacities[backend_id]
                spec += (key_id(key), capacity.hbm_blocks, capacity.host_blocks)
            args += (match_spec_struct(len(m.blocks_keys)).pack(*spec), m.packed)
        keys = [clock_key, *key_ids]
        if rider is not None:
            args[3:5] = (len(keys) + 1, rider.lease_ms)
            keys += (rider.own_key, *rider.read_keys)
            args += rider.fields
        return keys, args


def _settle(records: list[_Record], matches: list[_Match], rider: Rider | None, flat: list) -> None:
    """Resolve each call's future from the script's flat reply: one ``existed`` per record, then
    (matched, hbm) per backend of each match, then the rider's HGETALL replies."""
    for r in records:
        if not r.future.done():
            r.future.set_result(None)
    at = len(records)
    for m in matches:  # per backend: matched, hbm
        end = at + 2 * len(m.blocks_keys)
        if not m.future.done():
            m.future.set_result({b: BlockMatch(matched, hbm, matched - hbm) for b, matched, hbm
                                 in zip(m.blocks_keys, flat[at:end:2], flat[at + 1:end:2])})
        at = end
    if rider is not None and not rider.future.done():
        rider.future.set_result(flat[at])
