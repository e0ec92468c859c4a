"""Gateway replicas share their load: each publishes its ledgers' totals and reads the others'.

Several gateway processes (``serve --workers N``, Kubernetes replicas) in front of one fleet
each charge only the requests they routed; alone, each would see 1/N of every backend's
in-flight count, KV demand and queued prefill seconds, and κ routing would pile work on
backends the others already loaded (``bench/replicas.py``, ``--replica-state local`` vs
``synced``; BENCHMARKS.md). So, through the Redis the index already uses (`wire`: the keys and
commands, `figures`: the script and the figures' format):

- a replica keeps its per-backend totals in its own hash under a lease. Every
  ``sync_interval_s``, off the request path, the periodic exchange writes all of them, renews
  the lease and the membership and re-reads the member list: a replica alone writes only then,
  and one that joins is seen within that interval. While the request path's exchanges keep
  reading the others' figures, the periodic one runs once in ``SYNC_STRETCH_INTERVALS``;
- once it knows another replica, a ticket that changes its figures has them written at once,
  by the next exchange (`exchanges`: one in flight, changes coalesced, only the backends whose
  figures differ from the last written);
- every routing decision reads the other members' hashes (`refresh`, awaited by the dispatcher
  together with the index match, so it adds no round trip): it starts an exchange or joins the
  one in flight (`readers`), and the exchange sets each backend ledger's ``peer_*`` figures to
  the others' sums (`view`; `dispatch.Ledger`). Reading per decision, not per interval, is what
  keeps two replicas from piling one burst onto one backend (BENCHMARKS.md);
- a replica that stops (crash, kill -9) stops renewing its lease: its hash expires and its
  charges vanish from the others' view within the lease; readers drop expired members;
- the chains of requests in flight reach the other replicas through the index itself: with
  peers on, a request's chain is recorded when it is sent, not at its first byte
  (`gateway.proxy.attempts`).

On a single Redis, the request path's exchanges ride in the prefix index's batches (`ride_with`,
`prefix_index.redis_batch.Rider`) and cost no command of their own.

Consistency: eventual. A replica sees the others' load as of their last write — about one
round trip old, two when a write waited for the exchange in flight — and its own exactly. A
decision waits for the read at most the index's ``timeout_s``; a read that fails or is late
leaves the last figures in place. Redis trouble leaves them in place until their lease would
have run out, then zeroes them (each replica falls back to its own view); failures are counted
in ``gateway_peer_sync_errors_total``. All keys share the ``{peers}`` hash tag, so on a Redis
Cluster each exchange goes to one shard (``tests/integration/test_redis_cluster.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from dispatch import Target
from fleet_config.sections import DEFAULT_LOAD_SYNC_INTERVAL_S as DEFAULT_SYNC_INTERVAL_S
from gateway.replicas.exchanges import CARRY_WAIT_S, Exchanges
from gateway.replicas.figures import replica_id
from gateway.replicas.readers import Readers
from gateway.replicas.view import PeerView
from gateway.replicas.wire import EXCHANGE_TIMEOUT_S, Wire
from gateway.telemetry.outage import RECOVERY_STABLE_S, OutageLog
from prefix_index.errors import PrefixIndexError
from prefix_index.redis_batch import Rider
from prefix_index.redis_connect import RedisClient
from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S

log = logging.getLogger("kappa_gateway.peers")

__all__ = ["CARRY_WAIT_S", "DEFAULT_SYNC_INTERVAL_S", "LEASE_INTERVALS", "SYNC_STRETCH_INTERVALS", "PeerLoad"]

LEASE_INTERVALS = 20  # a replica's figures outlive it by this many sync intervals (at least 1 s)
# While the request path's exchanges keep reading the others' figures (one read within the last
# interval), the periodic exchange runs once in this many intervals, enough to renew the lease
# (LEASE_INTERVALS) and the membership and to find new members; otherwise at every interval.
SYNC_STRETCH_INTERVALS = 5


class PeerLoad:
    """The load exchange of this replica (module docstring): its periodic loop and its lease.

    Args:
        client: a redis-py asyncio client on the index's Redis (`prefix_index.redis_connect`).
        key_prefix: the index's key prefix.
        targets: this replica's backends (their ledgers are read and their ``peer_*`` set).
        sync_interval_s: seconds between periodic exchanges, > 0.
        read_timeout_s: the longest a decision waits for the others' figures, in seconds (the
            index's timeout).
        on_sync: called after each periodic exchange with the replicas seen (itself included).
        on_error: called once per failed exchange.
        recovery_stable_s: seconds of answered exchanges before an outage's "reachable again" line
            (`gateway.telemetry.outage`).
    """

    def __init__(self, client: RedisClient, key_prefix: str, targets: Sequence[Target], *,
                 sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S, read_timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_sync: Callable[[int], None] | None = None, on_error: Callable[[], None] | None = None,
                 recovery_stable_s: float = RECOVERY_STABLE_S) -> None:
        self.interval_s = sync_interval_s
        lease_ms = max(int(sync_interval_s * LEASE_INTERVALS * 1000), 1000)
        self._wire = Wire(client, key_prefix, replica_id(), lease_ms)
        self._view = PeerView(targets)
        self._readers = Readers(read_timeout_s)
        outage = OutageLog(log, clock=time.monotonic, stable_s=recovery_stable_s, errors_noun="exchange errors",
                           unavailable="replicas' load exchange unavailable ({detail}): routing on the other replicas' "
                                       "last figures, then on this replica's own load, until it recovers",
                           recovered="replicas' load exchange reachable again: the replicas' load is shared again")
        self._exchanges = Exchanges(self._wire, self._view, self._readers, on_error, outage)
        self._on_sync = on_sync
        self._last_ok_s: float | None = None  # loop time since which the others' figures are known fresh
        self._task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        """This replica's id among the members."""
        return self._wire.id

    @property
    def lease_ms(self) -> int:
        """How long this replica's figures outlive its last write, in milliseconds."""
        return self._wire.lease_ms

    @property
    def targets(self) -> list[Target]:
        return self._view.targets

    @property
    def replicas_seen(self) -> int:
        """1 + the other members, as of the last read."""
        return self._view.replicas_seen

    @property
    def errors(self) -> int:
        """Failed exchanges of the request path and of the loop, so far."""
        return self._exchanges.errors

    def ride_with(self, carry: Callable[[Callable[[], Rider | None]], bool]) -> bool:
        """Have the index's batches carry the request path's exchanges: ``carry`` is
        `prefix_index.redis_index.RedisPrefixIndex.carry`, which asks for a rider whenever a batch
        goes. Returns whether it will (not on a Redis Cluster)."""
        self._exchanges.carried = carry(self._exchanges.rider)
        return self._exchanges.carried

    def start(self) -> None:
        for i, t in enumerate(self.targets):
            t.ledger.on_change = functools.partial(self._changed, i)
        self._task = asyncio.create_task(self._run(), name="gateway-peer-load")

    def _changed(self, i: int) -> None:
        """A ticket changed target ``i``'s figures: have them written now, or by the next
        exchange if one is in flight — if another replica is there to read them. Alone, the
        periodic `sync` keeps them fresh for one that joins, and no request pays for a write."""
        self._view.dirty.add(i)
        if self._view.others and not self._exchanges.in_flight and not self._exchanges.stopped:
            self._exchanges.want(urgent=False)

    def read_due(self) -> bool:
        """Whether `refresh` would read anything now: another replica is known, and the exchange
        in flight is not late (a replica alone reads nothing, and its decisions await nothing)."""
        return bool(self._view.others) and not self._exchanges.stopped and not self._readers.late

    def refresh(self) -> Awaitable[None]:
        """The other replicas' figures, read now: a future that resolves once the exchange in
        flight (or one started now) has set ``peer_*``, or ``read_timeout_s`` after the first
        decision began to wait on that exchange, whichever is first (a late or failed read leaves
        the last figures). Never fails; one future per call, so a caller that is cancelled cancels
        nobody else's wait."""
        if not self.read_due():
            return self._readers.finished()
        waiter = self._readers.join()
        if not self._exchanges.in_flight:
            self._exchanges.want(urgent=True)
        return waiter

    async def sync(self) -> None:
        """The periodic exchange (`exchanges.Exchanges.sync`).

        Raises:
            IndexUnavailable: Redis failed or did not answer in time.
        """
        await self._exchanges.sync()

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's figures (a clean stop needs no lease to
        run out); an exchange in flight ends first, so nothing it writes lands after the withdrawal."""
        for t in self.targets:
            t.ledger.on_change = None
        self._exchanges.stopped = True  # ends the loop even if a cancel is lost (the loop checks it each turn)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._exchanges.stop(EXCHANGE_TIMEOUT_S)
        try:
            await self._wire.withdraw()
        except PrefixIndexError:
            pass  # the lease ends it

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        while not self._exchanges.stopped:
            started = loop.time()
            try:
                if self._stretched(started):
                    self._last_ok_s = self._exchanges.read_ok_s  # the others' figures are that fresh
                else:
                    async with asyncio.timeout(max(self.interval_s * 4, 0.5)):
                        await self.sync()
                    self._last_ok_s = started
            except (PrefixIndexError, TimeoutError, asyncio.CancelledError) as exc:
                if me is not None and me.cancelling():
                    raise  # a stop: asyncio.timeout can turn a cancel that meets its deadline into TimeoutError
                # Not a stop (a cancelled exchange is a failed one): the loop never ends but by `stop`,
                # or this replica would keep its last view of the others, and its lease, forever.
                if self._last_ok_s is None or started - self._last_ok_s > self.lease_ms / 1000:
                    self._view.clear()  # the others' figures are older than their lease: fall back to our own
                self._exchanges.failed(exc)
            if self._on_sync is not None:
                self._on_sync(self.replicas_seen)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.0))

    def _stretched(self, now: float) -> bool:
        """Whether the periodic exchange can skip this interval: the request path's exchanges read
        the others' figures within the last interval, and the last periodic one (lease, membership)
        is less than ``SYNC_STRETCH_INTERVALS`` intervals old."""
        return (bool(self._view.others) and now - self._exchanges.read_ok_s < self.interval_s
                and now - self._exchanges.synced_s < self.interval_s * SYNC_STRETCH_INTERVALS)
