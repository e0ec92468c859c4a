"""Coalescing of the Redis index's request-path calls: one EVALSHA per model per loop turn.

At concurrency, a gateway issues a ``match`` for every arriving request and a ``record``
for every request whose prefill started. Sent one by one, each costs a redis-py command
(packing, a socket write, a read, parsing: tens of µs of the gateway's CPU) and a Redis
command dispatch. :class:`Coalescer` queues the calls made during one event-loop turn
and sends them, per model, as one ``redis_lua.BATCH_LUA`` call at the end of the turn —
records first, then matches, so a match sees every record queued before it. A lone call
still goes out in the same turn (``loop.call_soon``), so coalescing adds no waiting.

It is the DataLoader pattern (batch the loads issued in one tick); it plays the role of
the pipelining LiteLLM's users asked for when per-request Redis round trips dominated
under load (BerriAI/litellm#6483).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.client import Redis
from redis.exceptions import RedisError

from prefix_index.base import BlockMatch, TierCapacity
from prefix_index.errors import IndexUnavailable
from prefix_index.redis_lua import BATCH_LUA

__all__ = ["Coalescer"]


@dataclass(slots=True)
class _Batch:
    """The calls queued for one model during one loop turn."""

    clock_key: str
    key_ids: dict[str, int] = field(default_factory=dict)  # blocks key -> KEYS index (1-based)
    record_args: list[Any] = field(default_factory=list)
    records: list[tuple[asyncio.Future, tuple[str, str]]] = field(default_factory=list)  # (future, registration)
    match_args: list[Any] = field(default_factory=list)
    matches: list[tuple[asyncio.Future, Sequence[str]]] = field(default_factory=list)  # (future, backend ids)

    def key_id(self, key: str) -> int:
        index = self.key_ids.get(key)
        if index is None:
            index = self.key_ids[key] = len(self.key_ids) + 2  # KEYS[1] is the clock
        return index


class Coalescer:
    """Queues records and matches and sends each model's batch as one EVALSHA.

    Args:
        client: the index's ``redis.asyncio.Redis``.
        timeout_s: deadline of one batch, in seconds; past it every call in the batch
            fails with ``IndexUnavailable``.
        on_created: ``async (registry_key, model) -> None``, awaited (before the record's
            caller resumes) for each record that created its blocks key: the index adds
            the model to that backend's registry set there.
    """

    def __init__(self, client: Redis, timeout_s: float,
                 on_created: Callable[[str, str], Any]) -> None:
        self._script = client.register_script(BATCH_LUA)
        self._timeout_s = timeout_s
        self._on_created = on_created
        self._pending: dict[str, _Batch] = {}
        self._flush_scheduled = False
        self._in_flight: set[asyncio.Task] = set()
        self.batches_sent = 0  # for tests and benchmarks: how much coalescing happened
        self.calls_sent = 0

    def record(self, clock_key: str, blocks_key: str, packed: bytes, capacity: TierCapacity,
               registration: tuple[str, str]) -> asyncio.Future:
        """Queue a record; the future resolves to None once Redis has it.
        ``registration`` is (registry key, model), passed to ``on_created``."""
        batch = self._batch(clock_key)
        future = asyncio.get_running_loop().create_future()
        batch.record_args += (batch.key_id(blocks_key), capacity.total_blocks, packed)
        batch.records.append((future, registration))
        return future

    def match(self, clock_key: str, blocks_keys: dict[str, str], packed: bytes,
              capacities: dict[str, TierCapacity]) -> asyncio.Future:
        """Queue a match (``blocks_keys``: backend id -> key); the future resolves to
        backend id -> ``BlockMatch``."""
        batch = self._batch(clock_key)
        future = asyncio.get_running_loop().create_future()
        args = batch.match_args
        args.append(len(blocks_keys))
        for backend_id, key in blocks_keys.items():
            capacity = capacities[backend_id]
            args += (batch.key_id(key), capacity.hbm_blocks, capacity.host_blocks)
        args.append(packed)
        batch.matches.append((future, list(blocks_keys)))
        return future

    async def aclose(self) -> None:
        """Wait for the batches in flight (each bounded by the timeout)."""
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    def _batch(self, clock_key: str) -> _Batch:
        batch = self._pending.get(clock_key)
        if batch is None:
            batch = self._pending[clock_key] = _Batch(clock_key)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return batch

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for batch in pending.values():
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(self, batch: _Batch) -> None:
        keys = [batch.clock_key, *batch.key_ids]
        args = [len(batch.records), len(batch.matches), *batch.record_args, *batch.match_args]
        self.batches_sent += 1
        self.calls_sent += len(batch.records) + len(batch.matches)
        try:
            async with asyncio.timeout(self._timeout_s):
                flat = await self._script(keys=keys, args=args)
                created = [reg for (_, reg), existed in zip(batch.records, flat) if not existed]
                for registry_key, model in dict.fromkeys(created):
                    await self._on_created(registry_key, model)
        except (TimeoutError, RedisError) as exc:
            what = f"took longer than {self._timeout_s} s" if isinstance(exc, TimeoutError) else \
                f"failed: {type(exc).__name__}: {exc}"
            for future, _ in (*batch.records, *batch.matches):
                if not future.done():
                    error = IndexUnavailable(f"redis {_ops(batch)} {what}")
                    error.__cause__ = exc
                    future.set_exception(error)
            return
        except BaseException as exc:  # cancelled at shutdown, or a bug: no caller waits forever
            for future, _ in (*batch.records, *batch.matches):
                if not future.done():
                    future.set_exception(IndexUnavailable(f"redis batch aborted: {exc!r}"))
            raise
        for future, _ in batch.records:
            if not future.done():
                future.set_result(None)
        at = len(batch.records)
        for future, backend_ids in batch.matches:
            if not future.done():
                future.set_result({b: BlockMatch(*flat[at + 3 * i: at + 3 * i + 3]) for i, b in enumerate(backend_ids)})
            at += 3 * len(backend_ids)


def _ops(batch: _Batch) -> str:
    if batch.records and batch.matches:
        return "record+match"
    return "record" if batch.records else "match"


