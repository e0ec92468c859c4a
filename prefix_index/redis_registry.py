"""The Redis index's registry: per backend, the models it has a blocks key for.

``P:backend-models:<backend>`` (a SET of model names) is how ``forget`` and ``stats`` find
a backend's blocks keys without a SCAN over every model. It lives in another Redis
Cluster slot than the model's keys, so the record script cannot write it: the index adds
to it after a batch, from :meth:`Registry.add`.

Expiry (issue 16). Blocks keys expire ``key_ttl_s`` after their last record
(``redis_lua``); the registry must not expire before them, or ``forget`` would miss a live
key. It is written (SADD + EXPIRE) when a record created a blocks key, and otherwise at
least every ``REFRESH_SHARE`` × ``key_ttl_s`` per (backend, model) this process records,
with a TTL of ``key_ttl_s`` × (1 + ``REFRESH_SHARE``): a registry refreshed at most
``REFRESH_SHARE`` × ttl before a record outlives the blocks key that record refreshed.
A refresh also re-adds a model that a record racing a ``forget`` left out (the Cluster
caveat in ``redis_index``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from redis.asyncio.client import Redis
from redis.asyncio.cluster import RedisCluster

__all__ = ["REFRESH_SHARE", "Registry"]

# Refresh a (backend, model) entry after this share of the key TTL (6 h of the default 24 h).
REFRESH_SHARE = 0.25


class Registry:
    """When to (re)write registry entries, and writing them.

    Args:
        client: the index's ``redis.asyncio.Redis`` or ``RedisCluster``.
        key_ttl_s: the blocks keys' TTL, in seconds (>= 1).
        clock: monotonic seconds, read to pace refreshes.
    """

    def __init__(self, client: Redis | RedisCluster, key_ttl_s: int, clock: Callable[[], float]) -> None:
        self._client = client
        self._refresh_s = key_ttl_s * REFRESH_SHARE
        self.ttl_s = math.ceil(key_ttl_s * (1 + REFRESH_SHARE))
        self._clock = clock
        self._written: dict[tuple[str, str], float] = {}  # (registry key, model) -> clock() of the last write

    def due(self, registration: tuple[str, str], created: bool) -> bool:
        """Whether a record of ``registration`` = (registry key, model) must write it: the record
        created its blocks key, or this process has not written the entry for a refresh interval."""
        if created:
            return True
        written = self._written.get(registration)
        return written is None or self._clock() - written >= self._refresh_s

    async def add(self, registrations: Iterable[tuple[str, str]]) -> None:
        """SADD each model to its registry key and EXPIRE the key, in one pipeline.

        Raises:
            redis.exceptions.RedisError: as the client raises it (the caller translates it).
        """
        pairs = list(dict.fromkeys(registrations))
        async with self._client.pipeline(transaction=False) as pipe:
            for key, model in pairs:
                pipe.sadd(key, model)
            for key in dict.fromkeys(key for key, _ in pairs):
                pipe.expire(key, self.ttl_s)
            await pipe.execute()
        now = self._clock()
        for pair in pairs:
            self._written[pair] = now

    def forgot(self, registry_key: str) -> None:
        """A ``forget`` removed the registry key's models: the next record writes them again."""
        for pair in [p for p in self._written if p[0] == registry_key]:
            del self._written[pair]
