"""A deadline that times the awaited store, not the event loop's lag.

``asyncio.timeout(0.05)`` fires when its timer is due *and the loop gets to it*. If a
CPU-bound callback holds the loop for 80 ms while a healthy Redis answers in 0.2 ms, the
answer waits in the socket buffer; when the loop resumes, one pass of the loop reads the
socket (the reply) and runs the expired timer, and the timer cancels the task whose reply
just arrived. The index then counts an error that Redis did not make (issue 16).

:class:`Deadline` cancels only after a pass of the loop that comes after the budget: when
its timer first fires, however late, it re-arms once for a grace of ``grace_s``
(``GRACE_RATIO`` × budget by default), and cancels when that grace timer fires. The loop
runs in passes (CPython's ``BaseEventLoop._run_once``): one pass polls the selector,
queues the I/O callbacks, then queues the expired timers, and runs them in that order; a
task woken by that I/O runs early in the next pass, before any timer that expires later.
So an answer that came in while the loop was stalled, which the stalled timer would
have beaten, is read in the pass that runs the first timer and delivered in the next:
the call completes, and the grace timer is cancelled with the deadline.

A store that does not answer costs ``budget_s + grace_s`` (55 ms for the index's 50 ms),
plus whatever the loop itself lags. What this deadline cannot tell is a request that a
stall kept from being *sent*: time it from the send (as ``redis_batch`` times a batch),
and give a caller that queues work before the send a longer deadline of its own.

Stdlib only (``asyncio.Timeout`` does the cancelling and raises the ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

__all__ = ["GRACE_RATIO", "Deadline"]

# Grace after the budget, as a share of it: 5 ms for the index's 50 ms, far above the
# ~0.1 ms a pass of an unloaded loop takes, far below the budget.
GRACE_RATIO = 0.1


class Deadline:
    """``async with Deadline(budget_s):`` — like ``asyncio.timeout``, minus the loop's stalls.

    Args:
        budget_s: time the awaited operation may take, in seconds, > 0 and finite.
        grace_s: slack after the budget for a reply the loop has not processed yet, in
            seconds, >= 0 (default ``GRACE_RATIO`` × budget).

    Raises:
        ValueError: a budget that is not finite and > 0, or a negative grace.
        TimeoutError: (on exit) the deadline expired and cancelled the body, as
            ``asyncio.timeout`` raises it.
    """

    __slots__ = ("_budget_s", "_grace_s", "_timeout", "_loop", "_graced", "_handle")

    def __init__(self, budget_s: float, grace_s: float | None = None) -> None:
        if not math.isfinite(budget_s) or budget_s <= 0:
            raise ValueError(f"budget_s must be finite and > 0, got {budget_s!r}")
        grace = budget_s * GRACE_RATIO if grace_s is None else grace_s
        if not math.isfinite(grace) or grace < 0:
            raise ValueError(f"grace_s must be finite and >= 0, got {grace_s!r}")
        self._budget_s, self._grace_s = budget_s, grace
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self._graced = False

    async def __aenter__(self) -> Deadline:
        await self._timeout.__aenter__()
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_at(self._loop.time() + self._budget_s, self._check)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired
        return None

    def _check(self) -> None:
        now = self._loop.time()
        if not self._graced:  # an answer may have been read in this pass: let the next one deliver it
            self._graced = True
            self._handle = self._loop.call_at(now + self._grace_s, self._check)
            return
        self._handle = None
        self._timeout.reschedule(now)  # asyncio.Timeout cancels the body (next pass) and raises TimeoutError
