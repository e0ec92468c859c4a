"""Request ids without a system call per request: a random tag per process, then a counter.

The gateway names every request it serves (when the client's ``X-Request-Id`` is not a safe
token, `gateway.proxy.handler.request_id_of`) and every upstream attempt
(`gateway.upstream.request`). Those ids must be unique — vLLM rejects or confuses two requests
in flight under one id — but they are not secrets: they are echoed to the client and logged.
``uuid4()`` and ``secrets.token_hex`` read the kernel's random source on every call, a
system call per id that shows in the gateway's CPU profile under load (measured in
BENCHMARKS.md, "The hot path (issue 14)"). So each process draws 64 random bits once (at
import, and again in a forked child) and numbers its ids after them: unique within the
process by the counter, and across processes and restarts by the tag (two replicas share a
tag with probability 2**-64).
"""

from __future__ import annotations

import itertools
import os
import secrets

_TAG_HEX_CHARS = 16  # 64 random bits


def _fresh() -> None:
    global _tag, _counter
    _tag = secrets.token_hex(_TAG_HEX_CHARS // 2)
    _counter = itertools.count(1)


_tag: str
_counter: itertools.count[int]
_fresh()
os.register_at_fork(after_in_child=_fresh)


def new_request_id() -> str:
    """A gateway request id: 32 lowercase hex characters (the length of a ``uuid4().hex``)."""
    return f"{_tag}{next(_counter):016x}"


def attempt_suffix() -> str:
    """A suffix unique to this process's call: its tag then a counter, in hex (≥ 17 characters)."""
    return f"{_tag}{next(_counter):x}"
