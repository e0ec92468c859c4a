"""The exact, event-fed index in Redis, shared by gateway replicas that each subscribe to the events.

Implements `engine_index.EngineIndex` (rules in its module docstring; the contract suite checks it
agrees with `engine_memory.MemoryEngineIndex`). Keys, ``P`` the key prefix and ``{M}`` the model's
hash tag (as `redis_index`'s, so a model's keys share a Redis Cluster slot)::

    P:{M}:ev:<backend>:meta | :map | :hbm | :host     (engine_lua's module docstring)

Round trips. ``apply``: one read script (position, sizes and the parents' own hashes:
`engine_lua.READ_LUA`), then — only for the replica whose batch is the next — one apply script
(`engine_lua.APPLY_LUA`) that re-checks the position and applies the batch atomically; a replica
that hears ``duplicate`` (the common case for all replicas but the fastest) pays one round trip.
``match``: one script for every candidate (`engine_lua.MATCH_LUA`), linear in each backend's
matched blocks (a miss on block 0 costs one probe). Each key's TTL (``key_ttl_s``) is refreshed by
every applied batch, so a retired backend's state expires. Redis failures become
``IndexUnavailable`` (`redis_errors.map_redis_errors`) under a `deadline.Deadline`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from prefix_index.deadline import Deadline
from prefix_index.engine_events import EventBatch, Tier
from prefix_index.engine_index import (
    DEFAULT_MAX_BLOCKS_PER_BACKEND,
    ApplyCounts,
    ApplyOutcome,
    ApplyResult,
    EngineState,
    ExactMatch,
    block_size_of,
    chains_by_block_size,
    decide,
    parents_needed,
    plan_ops,
)
from prefix_index.engine_lua import APPLY_LUA, CLEAR_LUA, MATCH_LUA, READ_LUA, pack_ops
from prefix_index.errors import IndexUnavailable
from prefix_index.redis_connect import RedisClient, connect
from prefix_index.redis_defaults import DEFAULT_ADMIN_TIMEOUT_S, DEFAULT_KEY_PREFIX, DEFAULT_KEY_TTL_S, DEFAULT_TIMEOUT_S
from prefix_index.redis_errors import map_redis_errors
from prefix_index.redis_index import _tag

__all__ = ["RedisEngineIndex"]

# Reads before an apply gives up when other replicas keep moving the position in between: each
# retry means another replica applied a batch, so a handful suffices; past it IndexUnavailable.
MAX_APPLY_ATTEMPTS = 8
_T = TypeVar("_T")


class RedisEngineIndex:
    """`EngineIndex` in Redis.

    Args:
        client: a ``redis.asyncio`` client *without* ``decode_responses`` (hashes are binary);
            closed by `aclose` only if ``owns_client``.
        key_prefix: first segment of every key, without braces.
        timeout_s: deadline of a ``match`` (the request path), > 0.
        apply_timeout_s: deadline of each ``apply``, ``clear`` and ``state`` round trip, > 0.
        key_ttl_s: expiry of the keys, refreshed by each applied batch, >= 1.
        max_blocks_per_backend: engine blocks per (model, backend), >= 1 (`engine_index`'s bound).

    Raises:
        ValueError: a bad prefix, timeout, TTL or cap.
    """

    def __init__(self, client: RedisClient, *, key_prefix: str = DEFAULT_KEY_PREFIX,
                 timeout_s: float = DEFAULT_TIMEOUT_S, apply_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
                 key_ttl_s: int = DEFAULT_KEY_TTL_S, max_blocks_per_backend: int = DEFAULT_MAX_BLOCKS_PER_BACKEND,
                 owns_client: bool = False, close: Callable[[], Awaitable[None]] | None = None) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be non-empty without braces, got {key_prefix!r}")
        if not timeout_s > 0 or not apply_timeout_s > 0 or key_ttl_s < 1 or max_blocks_per_backend < 1:
            raise ValueError("timeouts must be > 0, key_ttl_s and max_blocks_per_backend >= 1")
        self._client = client
        self._prefix = key_prefix
        self._timeout_s, self._apply_timeout_s = timeout_s, apply_timeout_s
        self._ttl_s, self._cap = key_ttl_s, max_blocks_per_backend
        self._owns_client = owns_client
        self._close = close or client.aclose
        self._read = client.register_script(READ_LUA)
        self._apply = client.register_script(APPLY_LUA)
        self._clear = client.register_script(CLEAR_LUA)
        self._match = client.register_script(MATCH_LUA)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisEngineIndex:
        """An index with its own client for ``url`` (any `redis_connect` form), closed by `aclose`;
        ``options`` are the constructor's keyword arguments."""
        timeout_s = options.get("timeout_s", DEFAULT_TIMEOUT_S)
        connection = connect(url, socket_timeout=20 * timeout_s, socket_connect_timeout=20 * timeout_s)
        return cls(connection.client, owns_client=True, close=connection.aclose, **options)

    def _keys(self, model: str, backend_id: str) -> list[str]:
        head = f"{self._prefix}:{{{_tag(model)}}}:ev:{backend_id}"
        return [f"{head}:meta", f"{head}:map", f"{head}:hbm", f"{head}:host"]

    async def apply(self, model: str, backend_id: str, seq: int, batch: EventBatch, *,
                    mid_stream_ok: bool = False, lost: bool = False) -> ApplyResult:
        """`EngineIndex.apply`: one read, then one atomic apply if the batch is the next.

        Raises:
            IndexUnavailable: Redis failed, was too slow, or the position kept moving
                (`MAX_APPLY_ATTEMPTS`).
            ValueError: ``seq`` < 0.
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        keys = self._keys(model, backend_id)
        parents = sorted(parents_needed(batch)) if not lost else []
        for _ in range(MAX_APPLY_ATTEMPTS):
            read = await self._bounded("kv-events read", lambda: self._read(keys, [_word(p) for p in parents]))
            last_raw, epoch = read[0], _text(read[5])
            last_seq, last_ts = (None, 0.0) if last_raw is None else (int(last_raw), float(read[1]))
            restart, ok = decide(last_seq, last_ts, seq, batch.ts, mid_stream_ok=mid_stream_ok)
            if not ok:
                empty = restart or last_seq is None
                outcome = ApplyOutcome.DUPLICATE if not empty and seq <= last_seq else ApplyOutcome.GAP
                if restart:  # the old stream's state goes now (only it: its origin is at or before
                    # its last ts), so a replay from 0 starts clean
                    await self.clear(model, backend_id, origin_before_ts=math.nextafter(last_ts, math.inf))
                return ApplyResult(outcome, restart, None if empty else _state(read), ApplyCounts())
            counts = ApplyCounts()
            known = {} if restart else {p: _int(own) for p, own in zip(parents, read[9:]) if own is not None}
            ops = [] if lost else plan_ops(model, batch, known.get, counts)
            size = block_size_of(batch)
            args = [epoch, "" if last_seq is None else str(last_seq), int(restart), str(seq), repr(batch.ts),
                    int(lost), "" if size is None else str(size), self._cap, self._ttl_s, pack_ops(ops)]
            done = await self._bounded("kv-events apply", lambda: self._apply(keys, args))
            if _text(done[0]) == "retry":
                continue
            counts.stored, counts.removed, counts.over_cap, counts.unknown_removed = (int(v) for v in done[1:5])
            counts.cleared = bool(int(done[10]))
            state = EngineState(seq, batch.ts, float(done[9]), _text(done[8]) == "1",
                                size or (int(read[4]) if read[4] and not restart else None), int(done[5]),
                                {Tier.HBM: int(done[6]), Tier.HOST: int(done[7])})
            return ApplyResult(ApplyOutcome.APPLIED, restart, state, counts)
        raise IndexUnavailable(f"kv-events apply for {backend_id}: the position moved {MAX_APPLY_ATTEMPTS} times")

    async def match(self, model: str, token_ids: Sequence[int], block_sizes: Mapping[str, int], *,
                    cache_salt: str | None = None) -> dict[str, ExactMatch]:
        """`EngineIndex.match` in one script call for every candidate.

        Raises:
            IndexUnavailable: Redis failed or did not answer within ``timeout_s``.
            ValueError: a block size <= 0 or a token id outside [0, 2**32).
        """
        chains = chains_by_block_size(model, token_ids, block_sizes, cache_salt)
        if not block_sizes:
            return {}
        packed, where = bytearray(), {}
        for size, chain in chains.items():
            where[size] = (len(packed), 8 * len(chain))
            packed += struct.pack(f">{len(chain)}Q", *chain)
        keys: list[str] = []
        spec = bytearray()
        for backend_id, size in block_sizes.items():
            keys += self._keys(model, backend_id)[2:]
            spec += struct.pack(">II", *where[size])
        with map_redis_errors("kv-events match", self._timeout_s):
            async with Deadline(self._timeout_s):
                flat = await self._match(keys, [bytes(packed), bytes(spec)])
        return {b: ExactMatch(int(flat[2 * i]), int(flat[2 * i + 1]), size)
                for i, (b, size) in enumerate(block_sizes.items())}

    async def clear(self, model: str, backend_id: str, *, origin_before_ts: float | None = None) -> bool:
        """`EngineIndex.clear` (one script call). Raises IndexUnavailable as `apply`."""
        arg = "" if origin_before_ts is None else repr(float(origin_before_ts))
        keys = self._keys(model, backend_id)
        return bool(await self._bounded("kv-events clear", lambda: self._clear(keys, [arg])))

    async def state(self, model: str, backend_id: str) -> EngineState | None:
        """`EngineIndex.state` (one script call). Raises IndexUnavailable as `apply`."""
        read = await self._bounded("kv-events read", lambda: self._read(self._keys(model, backend_id), []))
        return None if read[0] is None else _state(read)

    async def memory_usage_bytes(self, model: str, backend_id: str) -> int:
        """``MEMORY USAGE`` of the backend's four keys (for BENCHMARKS; not on any request path)."""
        total = 0
        for key in self._keys(model, backend_id):
            total += await self._bounded("memory usage", lambda k=key: self._client.memory_usage(k, samples=0)) or 0
        return total

    async def aclose(self) -> None:
        """Close the client if this index owns it (`from_url`)."""
        if self._owns_client:
            await self._close()

    async def _bounded(self, what: str, op: Callable[[], Awaitable[_T]]) -> _T:
        with map_redis_errors(what, self._apply_timeout_s):
            async with Deadline(self._apply_timeout_s):
                return await op()


def _word(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _int(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _state(read: list[Any]) -> EngineState:
    """An `EngineState` from `READ_LUA`'s answer (a non-empty state)."""
    return EngineState(int(read[0]), float(read[1]), float(read[2]), _text(read[3]) == "1",
                       int(read[4]) if read[4] else None, int(read[6]), {Tier.HBM: int(read[7]), Tier.HOST: int(read[8])})
