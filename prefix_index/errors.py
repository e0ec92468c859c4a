"""Exceptions raised by the prefix index.

Every error this package raises derives from one base, so a caller can catch the
package as a whole or one failure precisely (shape of ``httpx/_exceptions.py``)::

    PrefixIndexError
     ├── IndexUnavailable          backend store unreachable, slow or failing
     │    └── IndexCircuitOpen     not asked at all: the circuit breaker is open
     └── CanonicalizationError     request body cannot be turned into canonical bytes
         │                         (also a ``ValueError``): the body is malformed
         └── NestingTooDeep        a well-formed body nested beyond what the encoder
                                   can walk: the canonicaliser's limit, not the body's fault

Foreign exceptions are translated once, at the seam: ``redis.exceptions.*``, socket
``OSError`` and timeouts become :class:`IndexUnavailable` in ``redis_errors.py`` only
(``map_redis_errors``, around every Redis call of ``redis_index``, ``redis_batch`` and the
gateway replicas' load exchange), raised ``from`` the original so the cause stays in the
traceback. ``tests/test_redis_seam.py`` keeps it so.
"""

from __future__ import annotations

__all__ = ["CanonicalizationError", "IndexCircuitOpen", "IndexUnavailable", "NestingTooDeep", "PrefixIndexError"]


class PrefixIndexError(Exception):
    """Base class of every error raised by :mod:`prefix_index`."""


class IndexUnavailable(PrefixIndexError):
    """The index's backing store could not answer within its time budget.

    Raised by :class:`prefix_index.redis_index.RedisPrefixIndex` (and the gateway replicas'
    load exchange) for a refused or dropped connection, a timeout, or any other Redis error
    (`redis_errors.map_redis_errors`). Callers on the request path degrade on purpose:
    treat it as "no prefix match" and count it.
    """


class IndexCircuitOpen(IndexUnavailable):
    """The call was skipped, at once, because the index's circuit breaker is open.

    Raised by :class:`prefix_index.breaker.BreakerIndex` after consecutive failures of the
    store, until a probe succeeds. Callers degrade as for ``IndexUnavailable`` (no prefix
    match) but count it apart: it is a skip, not a failure of the store.
    """


class CanonicalizationError(PrefixIndexError, ValueError):
    """A request body has a shape the canonicaliser cannot represent.

    For example ``messages`` that is not a list, message content that is neither a
    string nor a list of parts, or a token id that is not a non-negative int. The
    message names the offending field (``messages[2].content``).
    """


class NestingTooDeep(CanonicalizationError):
    """A value to encode as canonical JSON is nested deeper than the encoder can go.

    ``json.dumps`` recurses once per level of nesting and stops at Python's recursion
    limit (``sys.getrecursionlimit()``, 1,000 by default, less the caller's own stack), so
    ``tools``, ``chat_template_kwargs``, a message's ``tool_calls`` or a media part nested
    ~1,000 levels deep cannot be encoded, while a JSON parser such as orjson (limit 1,024)
    accepts it. Such a body is well-formed: it is the canonicaliser that cannot represent
    it, so a caller that can still send the request on routes it without prefix hashes
    (the gateway: load-only routing, counted in ``gateway_load_only_requests_total``)
    rather than refusing it. ``reason`` is the closed-set label of that counter.
    """

    reason = "nesting_too_deep"
