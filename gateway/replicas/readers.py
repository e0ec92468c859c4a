"""The routing decisions waiting for the other replicas' figures, and how long they wait.

Concurrent decisions share one read: each joins the exchange in flight with a future of its
own (a caller that is cancelled cancels nobody else's wait). They are released when the
exchange ends, or ``read_timeout_s`` after the first of them joined it, whichever is first;
past that the read is late, and decisions go on with the last figures at once until that
exchange ends.
"""

from __future__ import annotations

import asyncio


class Readers:
    """The decisions waiting on the exchange in flight.

    Args:
        read_timeout_s: the longest a decision waits for a read, in seconds (the index's timeout:
            the read runs beside the index match, which takes as long).
    """

    def __init__(self, read_timeout_s: float) -> None:
        self.read_timeout_s = read_timeout_s
        self.late = False  # the exchange in flight is past read_timeout_s
        self._waiters: list[asyncio.Future[None]] = []
        self._late_timer: asyncio.TimerHandle | None = None
        self._done: asyncio.Future[None] | None = None  # a finished future, for decisions that need no read

    @property
    def waiting(self) -> bool:
        return bool(self._waiters)

    def join(self) -> asyncio.Future[None]:
        """A future of its own for one decision, resolved by `exchange_ended` or the timeout."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        if self._late_timer is None:
            self._late_timer = loop.call_later(self.read_timeout_s, self._give_up)
        return waiter

    def finished(self) -> asyncio.Future[None]:
        """A resolved future, for a decision that reads nothing."""
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            self._done.set_result(None)
        return self._done

    def exchange_ended(self) -> None:
        """The exchange in flight ended (read, failed or skipped): release everyone, not late."""
        if self._late_timer is not None:
            self._late_timer.cancel()
            self._late_timer = None
        self.late = False
        self.release()

    def release(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _give_up(self) -> None:
        self._late_timer = None
        self.late = True  # until the exchange in flight ends
        self.release()
