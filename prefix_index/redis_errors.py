"""The one place where redis-py's exceptions become this package's (`errors.IndexUnavailable`).

Every Redis call of the index (`redis_index`, `redis_batch`) and of the gateway replicas' load
exchange (`gateway.replicas.wire`) runs inside :func:`map_redis_errors`, so a caller sees one
error type whatever failed: a ``redis.exceptions.RedisError`` (refused or dropped connection,
redis-py's socket timeout, a script error), an ``OSError`` from the socket that redis-py let
through, or the ``TimeoutError`` of a deadline around the call. The original stays the
``__cause__``. Shape of httpx's ``map_httpcore_exceptions`` (``httpx/_transports/default.py``):
one context manager around the call, the mapping in one table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import RedisError

from prefix_index.errors import IndexUnavailable

__all__ = ["map_redis_errors"]


@contextmanager
def map_redis_errors(what: str, timeout_s: float, *, late: str | None = None) -> Iterator[None]:
    """Translate what a Redis call raises into `IndexUnavailable`, ``raise ... from`` the original.

    Args:
        what: the call, for the message (``match``, ``record+match``, ``peer load exchange``).
        timeout_s: the deadline around the call, in seconds, for the message of a timeout.
        late: the message's tail for a timeout, instead of ``took longer than <timeout_s> s``.

    Raises:
        IndexUnavailable: ``TimeoutError`` (the deadline; checked first, as it is an ``OSError``),
            ``redis.exceptions.RedisError`` or ``OSError`` raised inside the block. Anything else
            (``CancelledError`` included) passes unchanged.
    """
    try:
        yield
    except TimeoutError as exc:
        raise IndexUnavailable(f"redis {what} {late or f'took longer than {timeout_s} s'}") from exc
    except (RedisError, OSError) as exc:
        raise IndexUnavailable(f"redis {what} failed: {type(exc).__name__}: {exc}") from exc
