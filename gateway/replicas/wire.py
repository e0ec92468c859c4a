"""The load exchange on the wire: its keys, its Redis commands, what they return.

A replica's figures live in its hash ``<key_prefix>:{peers}:r:<replica id>`` under a lease
(``PEXPIRE``); the members are the set ``<key_prefix>:{peers}:members``. The ``{peers}`` hash tag
keeps every key of an exchange in one Redis Cluster slot, so an exchange goes to one shard. An
exchange is one EVALSHA of `figures.EXCHANGE_LUA` (or rides in an index batch as a
`prefix_index.redis_batch.Rider`). Every command here runs inside
`prefix_index.redis_errors.map_redis_errors`: what fails is ``IndexUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.replicas.figures import EXCHANGE_LUA, text
from prefix_index.errors import IndexUnavailable
from prefix_index.redis_batch import Rider
from prefix_index.redis_connect import RedisClient
from prefix_index.redis_errors import map_redis_errors

EXCHANGE_TIMEOUT_S = 1.0  # one exchange, at most (the lane is blocked meanwhile; decisions wait less)
WITHDRAW_TIMEOUT_S = 1.0  # the withdrawal at stop, at most (past it, the lease ends the figures)

# Sets ``peer_*`` from the members read and their HGETALL replies; returns the members whose hash is gone.
Apply = Callable[[list[str], list], list[str]]


class Wire:
    """One replica's Redis keys and the commands of its exchanges.

    Args:
        client: a redis-py asyncio client on the index's Redis (`prefix_index.redis_connect`).
        key_prefix: the index's key prefix.
        replica_id: this replica's id (`figures.replica_id`).
        lease_ms: how long this replica's hash outlives its last write, in milliseconds.
    """

    def __init__(self, client: RedisClient, key_prefix: str, replica_id: str, lease_ms: int) -> None:
        self.client = client
        self.id = replica_id
        self.lease_ms = lease_ms
        self._script = client.register_script(EXCHANGE_LUA)
        self.members_key = f"{key_prefix}:{{peers}}:members"
        self._prefix = f"{key_prefix}:{{peers}}:r:"
        self.own_key = self._prefix + replica_id
        self._chores: set[asyncio.Task[None]] = set()  # member removals in flight (`forget_soon`)

    async def exchange(self, fields: dict[str, str], others: list[str], *, renew: bool, apply: Apply) -> None:
        """Write ``fields`` (backend id -> packed figures), read ``others``' hashes and ``apply``
        them, then drop from the members the ones ``apply`` found gone; with ``renew``, also renew
        this replica's membership and take the member list (reading any member not read yet).

        Raises:
            IndexUnavailable: Redis failed, or the whole took longer than ``EXCHANGE_TIMEOUT_S``.
        """
        with map_redis_errors("peer load exchange", EXCHANGE_TIMEOUT_S):
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                others, tables = await self._read(fields, others, renew=renew)
                gone = apply(others, tables)
                if gone:
                    await self.client.srem(self.members_key, *gone)

    async def _read(self, fields: dict[str, str], others: list[str], *, renew: bool) -> tuple[list[str], list]:
        """The script call(s): the members read, in order, and their HGETALL replies."""
        args: list[str | int] = [self.lease_ms, self.id if renew else ""]
        for backend, packed in fields.items():
            args += (backend, packed)
        tables, members = await self._script(keys=[self.own_key, self.members_key, *self._keys(others)], args=args)
        if not renew:
            return others, tables
        listed = sorted(text(m) for m in members if text(m) != self.id)
        new = [m for m in listed if m not in others]
        if new:  # joined since the last membership read: read them too, before the figures are set
            more, _ = await self._script(keys=[self.own_key, self.members_key, *self._keys(new)],
                                         args=[self.lease_ms, ""])
            others, tables = others + new, list(tables) + list(more)
        gone_from_list = set(others) - set(listed)
        if gone_from_list:
            kept = [(m, t) for m, t in zip(others, tables, strict=True) if m not in gone_from_list]
            others, tables = [m for m, _ in kept], [t for _, t in kept]
        return others, tables

    def rider(self, fields: dict[str, str], others: list[str], future: asyncio.Future) -> Rider:
        """The exchange as a batch of the index carries it: write ``fields``, read ``others``'
        hashes; ``future`` resolves to their HGETALL replies (`prefix_index.redis_batch.Rider`)."""
        return Rider(self.own_key, [x for pair in fields.items() for x in pair], self.lease_ms,
                     self._keys(others), future)

    def forget_soon(self, gone: list[str]) -> None:
        """Drop ``gone`` from the members (their lease ran out), in the background; a failure is
        ignored: the next periodic exchange drops them again. `drain` waits for these."""
        chore = asyncio.ensure_future(self._forget(gone))
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    async def _forget(self, gone: list[str]) -> None:
        try:
            with map_redis_errors("peer member removal", EXCHANGE_TIMEOUT_S):
                async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                    await self.client.srem(self.members_key, *gone)
        except IndexUnavailable:
            pass

    async def drain(self) -> None:
        """Wait for the member removals of `forget_soon` (each bounded by ``EXCHANGE_TIMEOUT_S``)."""
        if self._chores:
            await asyncio.gather(*self._chores, return_exceptions=True)

    async def withdraw(self) -> None:
        """Delete this replica's hash and membership (a clean stop needs no lease to run out).

        Raises:
            IndexUnavailable: Redis failed or took longer than ``WITHDRAW_TIMEOUT_S``.
        """
        with map_redis_errors("peer withdrawal", WITHDRAW_TIMEOUT_S):
            async with asyncio.timeout(WITHDRAW_TIMEOUT_S):
                # UNLINK as a raw command: a cluster pipeline's unlink() is a coroutine, not a queued command.
                await self.client.pipeline(transaction=False).execute_command(
                    "UNLINK", self.own_key).srem(self.members_key, self.id).execute()

    def _keys(self, members: list[str]) -> list[str]:
        return [self._prefix + m for m in members]
