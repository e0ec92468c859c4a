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

from types import TracebackType

from redis.exceptions import RedisError

from prefix_index.errors import IndexUnavailable

__all__ = ["map_redis_errors"]


class map_redis_errors:  # noqa: N801 -- used as a context manager, named like contextlib's
    """Translate what a Redis call raises into `IndexUnavailable`, ``raise ... from`` the original.

    A class, not a ``contextlib.contextmanager`` generator: it wraps the index's calls on the
    request path, and a plain ``__enter__``/``__exit__`` costs a fraction of a generator's set-up.

    Args:
        what: the call, for the message (``match``, ``record+match``, ``peer load exchange``).
        timeout_s: the deadline around the call, in seconds, for the message of a timeout.
        waited: a timeout's message says the caller "waited longer than" ``timeout_s`` (a budget it
            stopped waiting at) rather than that the call "took longer than" it.

    Raises:
        IndexUnavailable: ``TimeoutError`` (the deadline; checked first, as it is an ``OSError``),
            ``redis.exceptions.RedisError`` or ``OSError`` raised inside the block. Anything else
            (``CancelledError`` included) passes unchanged.
    """

    __slots__ = ("what", "timeout_s", "waited")

    def __init__(self, what: str, timeout_s: float, *, waited: bool = False) -> None:
        self.what, self.timeout_s, self.waited = what, timeout_s, waited

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if isinstance(exc, TimeoutError):
            late = f"waited longer than {self.timeout_s:g} s" if self.waited else \
                f"took longer than {self.timeout_s} s"
            raise IndexUnavailable(f"redis {self.what} {late}") from exc
        if isinstance(exc, (RedisError, OSError)):
            raise IndexUnavailable(f"redis {self.what} failed: {type(exc).__name__}: {exc}") from exc
        return False
