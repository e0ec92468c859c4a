"""A deadline that times the awaited store, not the event loop's lag.

``asyncio.timeout(0.05)`` fires when its timer is due *and the loop gets to it*. If a
CPU-bound callback holds the loop for 80 ms while a healthy Redis answers in 0.2 ms, the
answer waits in the socket buffer; when the loop resumes, one pass of the loop reads the
socket (the reply) and runs the expired timer, and the timer cancels the task whose reply
just arrived. The index then counts an error that Redis did not make (issue 16: index
timeouts fired under plain CPU load).

:class:`Deadline` enforces a budget only once the loop has been responsive past it. Each
time its timer fires:

1. if the timer ran late by more than ``grace_s`` (``GRACE_RATIO`` × budget by default),
   the loop was stalled: the request may have gone out late, or its answer may be sitting
   unread, so the operation gets its whole ``budget_s`` again, from now;
2. otherwise (the loop was free), the first such on-time expiry re-arms once for
   ``grace_s``, so that an answer the loop has read, or reads in its next pass, completes
   the call; the next on-time expiry cancels it;
3. from ``CAP_RATIO`` × budget after entry on, a late timer no longer buys a new budget
   (except on its first firing): a frozen store behind a loop that stays busy still fails,
   about one budget and a stall after the cap.

So a store that does not answer costs ``budget_s + grace_s`` on an idle loop (55 ms for
the index's 50 ms), and a stall of the loop is not counted against the store: after it,
the store has a whole budget to answer. The ordering it relies on is CPython's ``BaseEventLoop._run_once``: one pass
polls the selector, queues the I/O callbacks, then queues the expired timers, and runs
them in that order; a task woken by the I/O runs in the following pass.

Stdlib only (``asyncio.Timeout`` does the cancelling and raises the ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

__all__ = ["CAP_RATIO", "GRACE_RATIO", "Deadline"]

# Grace after the budget, as a share of it: 5 ms for the index's 50 ms, far above the
# ~0.1 ms a pass of an unloaded loop takes, far below the budget.
GRACE_RATIO = 0.1
# Past this many budgets a late timer no longer buys a new budget (200 ms for 50 ms).
CAP_RATIO = 4.0


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

    __slots__ = ("_budget_s", "_grace_s", "_timeout", "_loop", "_start", "_due", "_first", "_graced", "_handle")

    def __init__(self, budget_s: float, grace_s: float | None = None) -> None:
        if not math.isfinite(budget_s) or budget_s <= 0:
            raise ValueError(f"budget_s must be finite and > 0, got {budget_s!r}")
        grace = budget_s * GRACE_RATIO if grace_s is None else grace_s
        if not math.isfinite(grace) or grace < 0:
            raise ValueError(f"grace_s must be finite and >= 0, got {grace_s!r}")
        self._budget_s, self._grace_s = budget_s, grace
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self._first, self._graced = True, False

    async def __aenter__(self) -> Deadline:
        await self._timeout.__aenter__()
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._due = self._start + self._budget_s
        self._handle = self._loop.call_at(self._due, self._check)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        return await self._timeout.__aexit__(exc_type, exc, tb)

    def _check(self) -> None:
        now = self._loop.time()
        stalled = now - self._due > self._grace_s
        if stalled and (self._first or now - self._start < CAP_RATIO * self._budget_s):
            rearm_s = self._budget_s  # the loop was stalled: a whole budget from now
        elif not self._graced:
            self._graced, rearm_s = True, self._grace_s  # an answer read but not yet delivered
        else:
            rearm_s = None
        self._first = False
        if rearm_s is not None:
            self._due = now + rearm_s
            self._handle = self._loop.call_at(self._due, self._check)
            return
        self._handle = None
        self._timeout.reschedule(now)  # asyncio.Timeout cancels the body (next pass) and raises TimeoutError
