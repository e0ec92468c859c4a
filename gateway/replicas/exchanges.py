"""When the load exchanges run: one in flight, changes coalesced, reads joined, carried if it can be.

One exchange is in flight at a time. It takes what is due when it starts: the figures changed
since the last one began (`view.PeerView.fields_due`) and the decisions waiting for a read
(`readers.Readers`); changes and reads made meanwhile go in the next one, which starts as soon
as this one ends. The periodic exchange (`Exchanges.sync`, which also renews the membership)
is one of them, taken by the next to start.

With the index's batches carrying the request path's exchanges (`Exchanges.carried`, single
Redis only), a due exchange waits for the next batch (`rider`): a decision's read is queued
after its match, so it rides in that match's batch, or goes alone at the end of the loop turn;
a change waits at most ``CARRY_WAIT_S`` for a batch, then goes alone. The periodic exchange
always goes alone. A batch that fails fails its rider too, counted like a failed exchange.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable

from gateway.replicas.readers import Readers
from gateway.replicas.view import PeerView
from gateway.replicas.wire import Wire
from gateway.telemetry.outage import OutageLog
from prefix_index.redis_batch import Rider

log = logging.getLogger("kappa_gateway.peers")

# With the exchange carried by the index's batches, how long a change waits for one before it is
# written alone, in seconds: an idle replica's change is written that late; a busy one's mostly
# rides (the trade-off measured in BENCHMARKS.md, "`serve --workers 2`").
CARRY_WAIT_S = 0.005


class Exchanges:
    """Starts the exchanges and settles their outcome (module docstring).

    Args:
        wire: the exchange's Redis commands.
        view: the figures owed and read.
        readers: the decisions waiting for a read.
        on_error: called once per failed exchange of the request path.
        outage: logs the outages (one line each way), told of every failure and answer.
    """

    def __init__(self, wire: Wire, view: PeerView, readers: Readers, on_error: Callable[[], None] | None,
                 outage: OutageLog) -> None:
        self.wire, self.view, self.readers = wire, view, readers
        self._on_error = on_error
        self.outage = outage
        self.errors = 0
        self.carried = False  # the index's batches carry the request path's exchanges
        self.stopped = False
        self.read_ok_s = -math.inf  # loop time of the last exchange that read the others' figures
        self.synced_s = -math.inf  # and of the last periodic one
        self._exchange: asyncio.Future[None] | None = None  # the one in flight
        self._sync_due: asyncio.Future[None] | None = None  # `sync` asked: the next exchange is a periodic one
        self._alone_soon = False  # `_alone` is due at the end of this loop turn
        self._alone_timer: asyncio.TimerHandle | None = None  # or after CARRY_WAIT_S, for a change

    @property
    def in_flight(self) -> bool:
        return self._exchange is not None

    def want(self, *, urgent: bool) -> None:
        """An exchange is due: now, alone; or, when carried, with the next batch (`rider`), else alone
        at the end of this loop turn for a decision's read (``urgent``: its match's batch, if any,
        goes in this turn), ``CARRY_WAIT_S`` later for a change only."""
        if not self.carried:
            self._begin()
        elif urgent:
            if not self._alone_soon:
                self._alone_soon = True
                asyncio.get_running_loop().call_soon(self._alone)
        elif self._alone_timer is None:
            self._alone_timer = asyncio.get_running_loop().call_later(CARRY_WAIT_S, self._alone)

    def _alone(self) -> None:
        """No batch took the exchange that was due: it goes as a command of its own."""
        self._alone_soon = False
        self._cancel_alone_timer()
        if self._exchange is None and not self.stopped and (self.readers.waiting or self.view.dirty or self._sync_due):
            self._begin()

    def _cancel_alone_timer(self) -> None:
        if self._alone_timer is not None:
            self._alone_timer.cancel()
            self._alone_timer = None

    def rider(self) -> Rider | None:
        """What a batch of the index carries when an exchange is due and none is in flight (the changed
        figures, the others' hashes to read); None when nothing is, or for the periodic exchange."""
        if self._exchange is not None or self.stopped or self._sync_due is not None or not self.view.others:
            return None
        fields = self.view.fields_due(sync=False)
        if not fields and not self.readers.waiting:
            return None
        others = list(self.view.others)
        rider = self.wire.rider(fields, others, asyncio.get_running_loop().create_future())
        self._exchange = rider.future
        rider.future.add_done_callback(functools.partial(self._rider_done, others))
        return rider

    def _rider_done(self, others: list[str], future: asyncio.Future) -> None:
        if future.cancelled():
            self.view.unsent()  # as for a failure, uncounted (the batch was aborted at shutdown)
        elif (exc := future.exception()) is not None:
            self.view.unsent()
            self.failed(exc)
        else:
            self.read_ok_s = asyncio.get_running_loop().time()
            self.outage.answered()
            gone = self.view.apply(others, future.result())
            if gone:
                self.wire.forget_soon(gone)
        self._exchange_done(future)

    def _begin(self) -> None:
        self._exchange = asyncio.ensure_future(self._exchange_once())
        self._exchange.add_done_callback(self._exchange_done)

    def _exchange_done(self, _: asyncio.Future[None]) -> None:
        self._exchange = None
        self.readers.exchange_ended()
        if self.stopped:
            return
        if self._sync_due is not None:
            self._begin()
        elif self.view.others and self.view.dirty:
            self.want(urgent=False)

    async def _exchange_once(self) -> None:
        """One exchange: takes what is due when it runs, so the changes and decisions of the loop
        turn that started it ride along. Never raises but CancelledError: a periodic exchange's
        failure goes to `sync`'s caller, any other's is counted here."""
        sync, self._sync_due = self._sync_due, None
        fields = self.view.fields_due(sync=sync is not None)
        if sync is None and not fields and not self.readers.waiting:
            return  # back where it was written last, and nobody waits for a read
        try:
            await self.wire.exchange(fields, self.view.others, renew=sync is not None, apply=self.view.apply)
        except Exception as exc:  # noqa: BLE001 -- Redis trouble never fails a request; counted, figures kept
            self.view.unsent()
            if sync is None:
                self.failed(exc)
            elif not sync.done():
                sync.set_exception(exc)
            return
        self.read_ok_s = asyncio.get_running_loop().time()
        self.outage.answered()
        if sync is not None:
            self.synced_s = self.read_ok_s
            if not sync.done():
                sync.set_result(None)

    async def sync(self) -> None:
        """The periodic exchange, by the next exchange to start: write all of this replica's
        figures, renew its lease and membership, read the member list and the others' figures,
        set ``peer_*``.

        Raises:
            IndexUnavailable: Redis failed or the exchange took longer than ``wire.EXCHANGE_TIMEOUT_S``.
        """
        if self._sync_due is None or self._sync_due.done():
            self._sync_due = asyncio.get_running_loop().create_future()
            # Its caller may be gone (the loop's timeout) when it fails: that failure is counted there.
            self._sync_due.add_done_callback(_retrieved)
        due = self._sync_due
        if self._exchange is None:
            self._begin()
        # Shielded: a caller's timeout (the loop's, while Redis is slow) must not cancel the future
        # the exchange will resolve; a later call waits for the same one.
        await asyncio.shield(due)

    def failed(self, exc: BaseException | None) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error()
        log.debug("peer load exchange failed: %r", exc)
        self.outage.failed(str(exc) or type(exc).__name__)

    async def stop(self, wait_s: float) -> None:
        """Start no more exchanges; wait at most ``wait_s`` for the one in flight, then for the
        wire's member removals."""
        self.stopped = True
        self._cancel_alone_timer()
        if self._exchange is not None:
            await asyncio.wait([self._exchange], timeout=wait_s)
        await self.wire.drain()
        self.readers.release()


def _retrieved(future: asyncio.Future[None]) -> None:
    """Mark a periodic exchange's failure as seen, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
