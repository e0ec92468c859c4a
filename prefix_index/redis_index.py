"""Redis-backed prefix index, shared by several gateway replicas.

This module owns :class:`RedisPrefixIndex`, the ``base.PrefixIndex`` semantics kept in
Redis sorted sets (https://redis.io/docs/latest/develop/data-types/sorted-sets/). Its calls
raise only ``IndexUnavailable`` for Redis trouble (``redis_errors.map_redis_errors``).

Keys (``P`` = key prefix, ``{M}`` = the model as a Redis Cluster hash tag, so all of one
model's keys share a slot; ``%``, ``{`` and ``}`` in the model are %-escaped)::

    P:{M}:blocks:<backend_id>    ZSET  member = 8-byte big-endian hash, score = logical clock
    P:{M}:clock                  INT   the model's logical clock (INCRBY n per record)
    P:backend-models:<backend>   SET   models with a blocks key for the backend (forget/stats)

Every key carries a TTL, refreshed when it is written: ``key_ttl_s`` for the blocks keys
and clocks (EXPIRE in the record script), a quarter more for the registry sets
(``redis_registry``). So a retired fleet's keys expire a day (the default) after its
last record instead of staying forever.

Round trips: every ``match`` and ``record`` issued for a model during one event-loop turn
goes out as one EVALSHA (``redis_batch.Coalescer``; ``redis_lua.BATCH_LUA`` runs the
records — INCRBY, ZADD (none for a chain already on top of its backend), ZREMRANGEBYRANK,
EXPIRE — then the matches, ``base.match_chain``'s two binary searches per backend with
ZREVRANK), plus an SADD and EXPIRE of the registry when a record created a blocks key (or
its entry is due for a refresh). A lone call is a batch of one, sent in the same turn.
Hashes travel as packed ARGV strings, sliced in Lua only where probed; a match's backends
(key index and capacities) as one packed string (``redis_lua.MATCH_SPEC_FORMAT``).

Deadlines time Redis, not the gateway's event loop (issue 16). A batch's deadline,
``timeout_s``, runs from the moment it is sent and is a `deadline.Deadline`: a CPU-bound
stall of the loop while Redis's answer waits in the socket is not a timeout. A call's own
deadline runs from when it is queued, which a stall of the loop may precede by the whole
stall, so it is longer, ``CALL_DEADLINE_RATIO`` × ``timeout_s``: it only bounds a record
queued behind a record batch in flight and a batch whose cancellation went astray. The
client's socket timeout is a last backstop, ``SOCKET_TIMEOUT_RATIO`` × ``timeout_s`` (1 s),
so it never fires first on a stalled loop either.

Redis Cluster (and Sentinel): :meth:`from_url` picks the client from the URL's scheme
(`redis_connect`: ``redis://``, ``redis+cluster://``, ``redis+sentinel://``). Every script
call passes every key it touches in KEYS, all under one model's hash tag, so one call is
one slot on one shard and atomic there; different models spread over the shards. The
registry key lives in another slot than the model's keys, so ``record`` is not atomic
across the two and ``forget`` is SMEMBERS then UNLINK/SREM, one key per command (a
cluster pipeline sends each to its slot's shard); ``stats`` SCANs every primary. A record
racing a forget can leave a blocks key the registry misses until the registry's next
refresh for that (model, backend), or the key's expiry. A shard that is down fails the
calls of the models it holds: the breaker (`breaker`) counts them like any Redis failure.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from prefix_index.base import NO_MATCH, BlockMatch, IndexStats, TierCapacity, check_hashes
from prefix_index.deadline import Deadline
from prefix_index.redis_batch import Coalescer, Rider
from prefix_index.redis_connect import connect
from prefix_index.redis_defaults import (  # defined there, redis-free, for the config to import too
    DEFAULT_ADMIN_TIMEOUT_S,
    DEFAULT_KEY_PREFIX,
    DEFAULT_KEY_TTL_S,
    DEFAULT_TIMEOUT_S,
)
from prefix_index.redis_errors import map_redis_errors
from prefix_index.redis_registry import Registry

__all__ = [
    "DEFAULT_ADMIN_TIMEOUT_S",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_KEY_TTL_S",
    "DEFAULT_TIMEOUT_S",
    "RedisPrefixIndex",
]

# A call's own deadline, from when it is queued, as a multiple of timeout_s (200 ms for
# 50 ms): its batch's deadline (timeout_s from the send) times Redis and fails it first;
# this one leaves room for a loop stall before the send (the 80 ms, and a
# loaded machine's round trip after it), bounds a record queued behind a record batch in
# flight (it is shed past it), and a batch whose cancellation was lost.
CALL_DEADLINE_RATIO = 4.0
# The client's socket and connect timeouts, as a multiple of timeout_s (1 s for 50 ms): a
# backstop for a write whose cancellation Python 3.11 swallowed (gh-86296), far above the
# deadlines so that a stalled loop does not trip it.
SOCKET_TIMEOUT_RATIO = 20.0

_T = TypeVar("_T")


class RedisPrefixIndex:
    """``PrefixIndex`` in Redis: shared by gateway replicas, survives gateway restarts.

    Every call runs under a `deadline.Deadline` (the event loop's stalls do not count) and
    raises only ``IndexUnavailable`` (or ``ValueError`` for bad hashes). Give a
    caller-owned client a ``socket_timeout`` of about ``SOCKET_TIMEOUT_RATIO`` ×
    ``timeout_s`` and few retries, as :meth:`from_url` does: redis-py wraps socket writes
    in ``asyncio.wait_for``, which on Python 3.11 can swallow a cancellation that lands as
    the write completes (CPython gh-86296, fixed in 3.12), and then only the socket
    timeout bounds the read that follows; a socket timeout near ``timeout_s`` would fire
    on a stalled loop before the deadline could tell.

    Args:
        client: a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``
            (``decode_responses`` either way). The caller owns it and closes it, unless
            ``owns_client`` is true.
        key_prefix: first segment of every key; no ``{`` or ``}`` (they would become
            the Cluster hash tag).
        timeout_s: deadline of a batch of ``match`` and ``record`` calls from its send, in
            seconds, > 0 (each call's own, from when it is queued: ``CALL_DEADLINE_RATIO`` ×).
        admin_timeout_s: deadline of ``forget`` and ``stats``, in seconds, > 0.
        key_ttl_s: expiry of every key, refreshed when it is written, in whole seconds, >= 1.
        owns_client: close ``client`` in :meth:`aclose`.
        clock: monotonic seconds, read to pace the registry's TTL refreshes.

    Raises:
        ValueError: a bad ``key_prefix``, timeout or TTL.
    """

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        admin_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
        key_ttl_s: int = DEFAULT_KEY_TTL_S,
        owns_client: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be non-empty without braces, got {key_prefix!r}")
        for name, value in (("timeout_s", timeout_s), ("admin_timeout_s", admin_timeout_s)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if isinstance(key_ttl_s, bool) or not isinstance(key_ttl_s, int) or key_ttl_s < 1:
            raise ValueError(f"key_ttl_s must be an int >= 1, got {key_ttl_s!r}")
        self._client = client
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._admin_timeout_s = admin_timeout_s
        self._owns_client = owns_client
        self._close: Callable[[], Awaitable[None]] = client.aclose
        self._registry = Registry(client, key_ttl_s, clock)
        self._coalescer = Coalescer(client, timeout_s, key_ttl_s, self._registry)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        admin_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
        key_ttl_s: int = DEFAULT_KEY_TTL_S,
    ) -> RedisPrefixIndex:
        """Create an index with its own client, closed by :meth:`aclose`.

        The client's connect and socket timeouts are the backstop ``SOCKET_TIMEOUT_RATIO``
        × ``timeout_s`` (each ``forget``/``stats`` command is still a single quick read)
        and it does not retry: a retry cannot fit in the request's deadline, and the next
        request tries again.

        Args:
            url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``), a Redis Cluster's
                ``redis+cluster://host:port,host:port``, or a Sentinel set's
                ``redis+sentinel://host:26379,host:26379/service`` (`redis_connect`).
            key_prefix, timeout_s, admin_timeout_s, key_ttl_s: as for the constructor.

        Returns:
            A ready index; connections open lazily on first use.

        Raises:
            ValueError: a URL `redis_connect.parse_redis_url` rejects.
        """
        backstop_s = timeout_s * SOCKET_TIMEOUT_RATIO
        connection = connect(
            url,
            socket_connect_timeout=backstop_s,
            socket_timeout=backstop_s,
            retry=Retry(NoBackoff(), 0),
        )
        index = cls(
            connection.client,
            key_prefix=key_prefix,
            timeout_s=timeout_s,
            admin_timeout_s=admin_timeout_s,
            key_ttl_s=key_ttl_s,
            owns_client=True,
        )
        index._close = connection.aclose  # also closes a Sentinel set's clients
        return index

    async def match(
        self, model: str, hashes: Sequence[int], capacities: Mapping[str, TierCapacity]
    ) -> dict[str, BlockMatch]:
        """`PrefixIndex.match` (`prefix_index.base`) in one round trip, coalesced with this
        loop turn's other calls; IndexUnavailable when Redis fails or does not answer within
        ``timeout_s``."""
        packed = _pack(hashes)  # checks them too: ValueError for a hash outside [0, 2**64)
        if not hashes or not capacities:
            return {backend_id: NO_MATCH for backend_id in capacities}
        keys = {backend_id: self._blocks_key(model, backend_id) for backend_id in capacities}
        future = self._coalescer.match(self._clock_key(model), keys, packed, capacities)
        return await self._await("match", future)

    async def record(
        self, model: str, backend_id: str, hashes: Sequence[int], capacity: TierCapacity
    ) -> None:
        """Touch the chain on ``backend_id`` and trim to capacity.

        Coalesced with the other calls of this loop turn into one EVALSHA, which also
        refreshes the TTL of the keys it writes; an SADD + EXPIRE of the backend's registry
        follows when the record created the blocks key or the entry is due for a refresh.

        Args:
            model: served model name.
            backend_id: the backend that served the chain.
            hashes: the chain, ints in [0, 2**64); empty is a no-op.
            capacity: the backend's capacity; only ``total_blocks`` blocks stay.

        Raises:
            IndexUnavailable: Redis failed or did not answer within ``timeout_s``.
            ValueError: a hash outside [0, 2**64).
        """
        packed = _pack(hashes)  # checks every hash: ValueError for one outside [0, 2**64)
        if not hashes:
            return
        # Blocks past total_blocks would get the lowest scores and be trimmed at once: not sent.
        packed = packed[: _WORD_BYTES * capacity.total_blocks]
        future = self._coalescer.record(self._clock_key(model), self._blocks_key(model, backend_id), packed, capacity,
                                        (self._registry_key(backend_id), model))
        await self._await("record", future)

    def carry(self, source: Callable[[], Rider | None]) -> bool:
        """Let the index's batches carry a lease-hash exchange (`redis_batch.Coalescer.carry`):
        False, and nothing changes, on a Redis Cluster."""
        return self._coalescer.carry(source)

    async def forget(self, backend_id: str) -> None:
        """Drop every entry of ``backend_id``, for all models (two round trips; on a Redis
        Cluster, one per shard holding the keys, in parallel).

        Raises:
            IndexUnavailable: Redis failed or did not answer within ``admin_timeout_s``.
        """
        registry = self._registry_key(backend_id)

        async def run() -> None:
            models = await self._client.smembers(registry)
            if not models:
                return
            async with self._client.pipeline(transaction=False) as pipe:
                for raw in models:
                    # One key per UNLINK: a cluster pipeline's unlink() is a coroutine that
                    # splits keys by slot, not a queued command.
                    pipe.execute_command("UNLINK", self._blocks_key(_text(raw), backend_id))
                    pipe.srem(registry, raw)
                await pipe.execute()

        await self._bounded("forget", self._admin_timeout_s, run)
        self._registry.forgot(registry)

    async def stats(self) -> IndexStats:
        """Return blocks per backend (ZCARD) and ``MEMORY USAGE`` of the index's keys.

        Finds backends by SCANning the registry keys (on a Redis Cluster, every primary);
        slow on big indexes, so keep it off the request path.

        Raises:
            IndexUnavailable: Redis failed or did not answer within ``admin_timeout_s``.
        """
        registry_head = f"{self._prefix}:backend-models:"

        async def run() -> IndexStats:
            pattern = _glob_escape(registry_head) + "*"
            registries = [key async for key in self._client.scan_iter(match=pattern, count=1000)]
            block_keys: list[tuple[str, str]] = []  # (backend_id, key)
            other_keys: set[str] = set()
            for registry in registries:
                name = _text(registry)
                backend_id = name[len(registry_head) :]
                other_keys.add(name)
                for raw in await self._client.smembers(registry):
                    model = _text(raw)
                    block_keys.append((backend_id, self._blocks_key(model, backend_id)))
                    other_keys.add(self._clock_key(model))
            async with self._client.pipeline(transaction=False) as pipe:
                for _, key in block_keys:
                    pipe.zcard(key)
                    pipe.memory_usage(key, samples=0)
                for key in other_keys:
                    pipe.memory_usage(key, samples=0)
                replies = await pipe.execute()
            blocks: dict[str, int] = {}
            for (backend_id, _), count in zip(block_keys, replies[0 : 2 * len(block_keys) : 2]):
                if count:
                    blocks[backend_id] = blocks.get(backend_id, 0) + count
            memory = sum(
                r or 0 for r in replies[1 : 2 * len(block_keys) : 2] + replies[2 * len(block_keys) :]
            )
            return IndexStats(blocks_by_backend=blocks, memory_bytes=memory)

        return await self._bounded("stats", self._admin_timeout_s, run)

    async def aclose(self) -> None:
        """Let the batches in flight finish, then close the client if this index owns it
        (``from_url``)."""
        await self._coalescer.aclose()
        if self._owns_client:
            await self._close()

    async def _await(self, what: str, future: asyncio.Future) -> Any:
        """A queued call's result, under the call's own deadline too (the batch has one)."""
        budget_s = self._timeout_s * CALL_DEADLINE_RATIO
        with map_redis_errors(what, budget_s, waited=True):
            async with Deadline(budget_s):
                return await future

    async def _bounded(self, what: str, timeout_s: float, op: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``op`` under a deadline; its timeout and Redis errors become ``IndexUnavailable``
        (`redis_errors.map_redis_errors`)."""
        with map_redis_errors(what, timeout_s):
            async with Deadline(timeout_s):
                return await op()

    def _blocks_key(self, model: str, backend_id: str) -> str:
        return f"{self._prefix}:{{{_tag(model)}}}:blocks:{backend_id}"

    def _clock_key(self, model: str) -> str:
        return f"{self._prefix}:{{{_tag(model)}}}:clock"

    def _registry_key(self, backend_id: str) -> str:
        return f"{self._prefix}:backend-models:{backend_id}"


_WORD_BYTES = 8  # one packed hash


def _pack(hashes: Sequence[int]) -> bytes:
    """Hashes as one string of 8-byte big-endian words (sliced in Lua).

    The packing checks each hash's range as it goes, so it stands in for `check_hashes` (one pass over
    the chain, not three: 1.8 µs for an 8k prompt's 127 hashes, against 3.1 µs for the check alone).

    Raises:
        ValueError: a hash outside [0, 2**64) (`check_hashes`' error).
    """
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error:
        check_hashes(hashes)  # out of range: the index's own ValueError
        raise


def _text(value: bytes | str) -> str:
    """A key or member as text, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


def _tag(model: str) -> str:
    """The model as a hash-tag body: %-escape ``%``, ``{`` and ``}`` (injective)."""
    if "%" in model or "{" in model or "}" in model:
        return model.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return model


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so SCAN MATCH treats ``text`` literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
