"""Gateway replicas share their load: each publishes its ledgers' totals and reads the others'.

Several gateway processes (``serve --workers N``, Kubernetes replicas) in front of one fleet
each charge only the requests they routed; alone, each would see 1/N of every backend's
in-flight count, KV demand and queued prefill seconds, and κ routing would pile work on
backends the others already loaded (measured in the simulator: ``bench/replicas.py``,
``--replica-state local`` vs ``synced``). So, through the Redis the index already uses:

- a replica keeps its per-backend totals in its hash ``P:{peers}:r:<replica id>`` (field:
  backend id, value: in-flight requests, KV demand bytes, outstanding prefill seconds) under a
  lease (``PEXPIRE``). Every ``sync_interval_s`` (default 50 ms), off the request path, it
  writes all of them, renews the lease and its membership in ``P:{peers}:members`` and
  re-reads the member list (a replica alone writes only then: a new one reads figures at most
  that old, and is seen within that interval). While the request path's exchanges keep reading
  the others' figures, this periodic one runs once in ``SYNC_STRETCH_INTERVALS`` intervals
  (250 ms): a busy replica finds one that joins within that;
- once it knows another replica, a ticket that changes its figures (`_changed`) has them
  written at once: by the exchange that starts then, or, if one is in flight, by the next,
  which starts as soon as that one ends (one exchange in flight at a time: changes meanwhile
  coalesce into the next). An exchange writes only the backends whose figures differ from
  the ones last written;
- every routing decision reads the other members' hashes (`refresh`, awaited by the
  dispatcher together with the index match, so a decision costs no extra latency): it starts
  an exchange, or joins the one in flight (concurrent decisions share one read), and the
  exchange sets each backend ledger's ``peer_*`` figures to the others' sums
  (`dispatch.Ledger`). Measured in the simulator (``bench/replicas.py``), reading at each
  decision matters: Mooncake's bursts arrive within the same millisecond, and a 50 ms-old
  view let two replicas pile a burst onto one backend (κ p90 1.21× one gateway's at N = 2,
  against 0.97× when read per decision);
- a replica that stops (crash, kill -9) stops renewing its lease: its hash expires and its
  charges vanish from the others' view within ``lease_s``; readers drop expired members;
- the chains of requests in flight reach the other replicas through the index itself: with
  peers on, a request's chain is recorded when it is sent, not at its first byte
  (`gateway.proxy.attempts`), so another replica routes a question about a document whose prefill
  is still running to where it runs.

An exchange is one Redis command whatever it carries (`gateway.replicas.figures`: the script, why
one command, the lease).

On a single Redis (not a Cluster, where these keys are in another slot than a model's), the
request path's exchanges ride in the prefix index's batches (`ride_with`,
`prefix_index.redis_batch.Rider`): the write of the changed figures and the read of the others'
hashes go at the end of the EVALSHA that carries the loop turn's index matches and records, and
cost no command of their own. A decision's read is queued after its match (the dispatcher awaits
the two in that order), so it rides in its match's batch; one whose turn sends no batch (a
request without prefix hashes, the index's breaker open) goes alone at the end of the turn. A
change waits at most ``CARRY_WAIT_S`` (5 ms) for a batch, then goes alone. The periodic exchange
always goes alone (it also renews the membership). Carried, ``serve --workers 2`` sent about one
EVALSHA in six fewer (2,257 → 1,902 in a 3 s cell at c = 32, 8k tokens) and a worker used ~3.5% less
CPU per request, side by side (BENCHMARKS.md, "`serve --workers 2`"); a batch that fails fails its
rider too (counted like a failed exchange).

Consistency: eventual. A replica sees the others' load as of their last write — about one
round trip old, two when a write waited for the exchange in flight — and its own exactly. A
decision waits for the read at most the index's ``timeout_s``, counted from the first decision
that waited on the same exchange (it runs beside the match, which takes as long); a read that
fails or is late leaves the last figures in place, and decisions go on with them at once until
that exchange ends. Redis trouble leaves them in place until their lease would have run
out, then zeroes them (each replica falls back to its own view); failures are counted in
``gateway_peer_sync_errors_total``. The ``{peers}`` hash tag keeps every key of the exchange
in one Redis Cluster slot, so each exchange goes to one shard
(``tests/integration/test_redis_cluster.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from dispatch import Target
from fleet_config.settings import DEFAULT_LOAD_SYNC_INTERVAL_S as DEFAULT_SYNC_INTERVAL_S
from gateway.replicas.figures import EXCHANGE_LUA, pack_figures, replica_id, sum_figures, text
from prefix_index.redis_batch import Rider
from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S

log = logging.getLogger("kappa_gateway.peers")

LEASE_INTERVALS = 20  # a replica's figures outlive it by this many sync intervals (1 s by default)
EXCHANGE_TIMEOUT_S = 1.0  # one exchange, at most (the lane is blocked meanwhile; decisions wait less)
# With the exchange carried by the index's batches, how long a change waits for one before it is
# written alone. A `serve --workers 2` worker at c = 32, 8k tokens sends a batch every ~3 ms: with
# 1 ms, two changes in three went alone (a command of its own, ~0.2 ms of the worker's CPU each);
# with 5 ms, one in five (counted per exchange, BENCHMARKS.md "`serve --workers 2`"). An idle
# replica's change is written 5 ms late.
CARRY_WAIT_S = 0.005
# While the request path's exchanges keep reading the others' figures (one read within the last
# interval), the periodic exchange runs once in this many intervals (250 ms by default), enough to
# renew the lease (1 s) and the membership and to find new members; otherwise at every interval.
SYNC_STRETCH_INTERVALS = 5
class PeerLoad:
    """The exchange (module docstring). Owns nothing but its Redis client.

    Args:
        client: a redis-py asyncio client on the index's Redis: ``Redis`` (one server, or a
            Sentinel set's master) or ``RedisCluster`` (`prefix_index.redis_connect`).
        key_prefix: the index's key prefix.
        targets: this replica's backends (their ledgers are read and their ``peer_*`` set).
        sync_interval_s: seconds between periodic exchanges, > 0.
        read_timeout_s: the longest a decision waits for the others' figures (the index's timeout).
        on_sync: called after each periodic exchange with the replicas seen (itself included).
        on_error: called once per failed exchange.
    """

    def __init__(self, client: redis.Redis | RedisCluster, key_prefix: str, targets: Sequence[Target], *,
                 sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S, read_timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_sync: Callable[[int], None] | None = None, on_error: Callable[[], None] | None = None) -> None:
        self.client, self.targets = client, list(targets)
        self.read_timeout_s = read_timeout_s
        self._script = client.register_script(EXCHANGE_LUA)
        self.errors = 0
        self.id = replica_id()
        self.interval_s = sync_interval_s
        self.lease_ms = max(int(sync_interval_s * LEASE_INTERVALS * 1000), 1000)
        self.members_key = f"{key_prefix}:{{peers}}:members"
        self._prefix = f"{key_prefix}:{{peers}}:r:"
        self._own_key = self._prefix + self.id
        self.replicas_seen = 1
        self._on_sync, self._on_error = on_sync, on_error
        self._others: list[str] = []  # the other members, as of the last membership read
        self._dirty: set[int] = set()  # indexes of the targets whose ledgers changed since the last exchange began
        self._sent: dict[str, str] = {}  # backend id -> figures last written (emptied when a write may have failed)
        self._exchange: asyncio.Task[None] | None = None  # the one in flight
        self._waiters: list[asyncio.Future[None]] = []  # decisions waiting for it
        self._late = False  # it is past read_timeout_s: decisions go on with the last figures
        self._late_timer: asyncio.TimerHandle | None = None
        self._sync_due: asyncio.Future[None] | None = None  # `sync` asked: the next exchange is a periodic one
        self._done: asyncio.Future[None] | None = None  # a finished future, for decisions that need no read
        self._last_ok_s: float | None = None
        self._read_ok_s = -math.inf  # loop time of the last exchange that read the others' figures
        self._synced_s = -math.inf  # and of the last periodic one
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._carried = False  # the index's batches carry the exchanges (`ride_with`)
        self._alone_soon = False  # `_alone` is due at the end of this loop turn
        self._alone_timer: asyncio.TimerHandle | None = None  # or after CARRY_WAIT_S, for a change
        self._chores: set[asyncio.Task[None]] = set()  # SREMs of expired members, from carried reads

    def ride_with(self, carry: Callable[[Callable[[], Rider | None]], bool]) -> bool:
        """Have the index's batches carry the request path's exchanges: ``carry`` is
        `prefix_index.RedisPrefixIndex.carry`, which asks `_rider` for one whenever a batch
        goes (module docstring). Returns whether it will (not on a Redis Cluster)."""
        self._carried = carry(self._rider)
        return self._carried

    def start(self) -> None:
        for i, t in enumerate(self.targets):
            t.ledger.on_change = functools.partial(self._changed, i)
        self._task = asyncio.create_task(self._run(), name="gateway-peer-load")

    # -- on the request path ------------------------------------------------------------------
    def _changed(self, i: int) -> None:
        """A ticket changed target ``i``'s figures: have them written now, or by the next
        exchange if one is in flight — if another replica is there to read them. Alone, the
        periodic `sync` keeps them fresh (within ``sync_interval_s``) for one that joins, and
        no request pays for a write."""
        self._dirty.add(i)
        if self._others and self._exchange is None and not self._stopped:
            self._want(urgent=False)

    def read_due(self) -> bool:
        """Whether `refresh` would read anything now: another replica is known, and the exchange
        in flight is not late (a replica alone reads nothing, and its decisions await nothing)."""
        return bool(self._others) and not self._stopped and not self._late

    def refresh(self) -> Awaitable[None]:
        """The other replicas' figures, read now: a future that resolves once the exchange in
        flight (or one started now) has set ``peer_*``, or ``read_timeout_s`` after the first
        decision began to wait on that exchange, whichever is first (a late or failed read leaves
        the last figures). Never fails; one future per call, so a caller that is cancelled cancels
        nobody else's wait."""
        if not self._others or self._stopped or self._late:
            return self._finished()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        if self._exchange is None:
            self._want(urgent=True)
        if self._late_timer is None:
            self._late_timer = loop.call_later(self.read_timeout_s, self._give_up_waiting)
        return waiter

    def _finished(self) -> asyncio.Future[None]:
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            self._done.set_result(None)
        return self._done

    def _give_up_waiting(self) -> None:
        self._late_timer = None
        self._late = True  # until the exchange in flight ends
        self._release()

    def _release(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- the exchange -------------------------------------------------------------------------
    def _want(self, *, urgent: bool) -> None:
        """An exchange is due: now, as a command of its own, or — when the index's batches carry
        it — with the next batch the index sends (`_rider`), else alone: at the end of this loop
        turn for a decision's read (``urgent``: its match's batch goes in this turn, if it has
        one), ``CARRY_WAIT_S`` later for a change only."""
        if not self._carried:
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
        if self._alone_timer is not None:
            self._alone_timer.cancel()
            self._alone_timer = None
        if self._exchange is None and not self._stopped and (self._waiters or self._dirty or self._sync_due):
            self._begin()

    def _rider(self) -> Rider | None:
        """What a batch of the index carries, when an exchange is due and none is in flight: the
        changed figures to write and the others' hashes to read (`prefix_index.redis_batch.Rider`).
        None when nothing is due, or for the periodic exchange, which also renews the membership
        and goes alone."""
        if self._exchange is not None or self._stopped or self._sync_due is not None or not self._others:
            return None
        fields = self._fields_due(sync=False)
        if not fields and not self._waiters:
            return None
        self._sent.update(fields)
        others = list(self._others)
        rider = Rider(self._own_key, [x for pair in fields.items() for x in pair], self.lease_ms,
                      [self._prefix + m for m in others], asyncio.get_running_loop().create_future())
        self._exchange = rider.future
        rider.future.add_done_callback(functools.partial(self._rider_done, others))
        return rider

    def _rider_done(self, others: list[str], future: asyncio.Future) -> None:
        if future.cancelled():
            self._sent.clear()  # as for a failure, uncounted (the batch was aborted at shutdown)
        elif (exc := future.exception()) is not None:
            self._sent.clear()  # landed or not, changes are never skipped as written; periodic rewrites all
            self._failed(exc)
        else:
            self._read_ok_s = asyncio.get_running_loop().time()
            gone = self._set_figures(others, future.result())
            if gone:
                chore = asyncio.ensure_future(self._forget_members(gone))
                self._chores.add(chore)
                chore.add_done_callback(self._chores.discard)
        self._exchange_done(future)

    def _begin(self) -> None:
        self._exchange = asyncio.ensure_future(self._exchange_once())
        self._exchange.add_done_callback(self._exchange_done)

    def _exchange_done(self, task: asyncio.Future[None]) -> None:
        self._exchange = None
        if self._late_timer is not None:
            self._late_timer.cancel()
            self._late_timer = None
        self._late = False
        self._release()
        if self._stopped:
            return
        if self._sync_due is not None:
            self._begin()
        elif self._others and self._dirty:
            self._want(urgent=False)

    async def _exchange_once(self) -> None:
        """One exchange (module docstring): takes what is due when it runs, so the changes and
        decisions of the loop turn that started it ride along. Never raises but CancelledError: a
        periodic exchange's failure goes to `sync`'s caller, any other's is counted here."""
        sync, self._sync_due = self._sync_due, None
        fields = self._fields_due(sync=sync is not None)
        if sync is None and not fields and not self._waiters:
            return  # back where it was written last, and nobody waits for a read
        self._sent.update(fields)
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                await self._call(fields, renew=sync is not None)
        except Exception as exc:  # noqa: BLE001 -- Redis trouble never fails a request; counted, figures kept
            self._sent.clear()  # landed or not, changes are never skipped as written; periodic rewrites all
            if sync is None:
                self._failed(exc)
            elif not sync.done():
                sync.set_exception(exc)
            return
        self._read_ok_s = asyncio.get_running_loop().time()
        if sync is not None:
            self._synced_s = self._read_ok_s
            if not sync.done():
                sync.set_result(None)

    def _fields_due(self, *, sync: bool) -> dict[str, str]:
        """The figures to write: all of them (``sync``), else those of the changed targets that
        differ from the ones last written; the changes are taken."""
        if sync:
            fields = {t.id: pack_figures(t) for t in self.targets}
        else:
            fields = {}
            for i in self._dirty:
                target = self.targets[i]
                packed = pack_figures(target)
                if self._sent.get(target.id) != packed:
                    fields[target.id] = packed
        self._dirty.clear()
        return fields

    async def _call(self, fields: dict[str, str], *, renew: bool) -> None:
        """Write ``fields``, read the others' hashes, set ``peer_*``; with ``renew``, also renew
        the membership and take the member list (then read any member not read yet)."""
        others = self._others
        args: list[str | int] = [self.lease_ms, self.id if renew else ""]
        for backend, packed in fields.items():
            args += (backend, packed)
        keys = [self._own_key, self.members_key, *(self._prefix + m for m in others)]
        tables, members = await self._script(keys=keys, args=args)
        if renew:
            listed = sorted(text(m) for m in members if text(m) != self.id)
            new = [m for m in listed if m not in others]
            if new:  # joined since the last membership read: read them too, before the figures are set
                more, _ = await self._script(keys=[self._own_key, self.members_key,
                                                   *(self._prefix + m for m in new)], args=[self.lease_ms, ""])
                others, tables = others + new, list(tables) + list(more)
            gone_from_list = set(others) - set(listed)
            if gone_from_list:
                kept = [(m, t) for m, t in zip(others, tables, strict=True) if m not in gone_from_list]
                others, tables = [m for m, _ in kept], [t for _, t in kept]
        await self._apply(others, tables)

    async def _apply(self, others: list[str], tables: list) -> None:
        """Set ``peer_*`` to the sums of ``others``' figures; drop members whose lease ran out."""
        gone = self._set_figures(others, tables)
        if gone:
            await self.client.srem(self.members_key, *gone)

    async def _forget_members(self, gone: list[str]) -> None:
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                await self.client.srem(self.members_key, *gone)
        except (RedisError, OSError, TimeoutError):
            pass  # the next periodic exchange drops them again

    def _set_figures(self, others: list[str], tables: list) -> list[str]:
        """Set ``peer_*`` to the sums of ``others``' figures (``tables``: their HGETALL replies,
        in order); return the members whose hash is gone (lease ran out), no longer read."""
        sums, gone = sum_figures([t.id for t in self.targets], others, tables)
        for t in self.targets:
            in_flight, kv, prefill = sums[t.id]
            t.ledger.peer_in_flight = int(in_flight)
            t.ledger.peer_kv_demand_bytes = kv
            t.ledger.peer_outstanding_prefill_s = prefill
        self._others = [m for m in others if m not in gone]
        self.replicas_seen = 1 + len(self._others)
        return gone

    def _failed(self, exc: BaseException | None) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error()
        log.debug("peer load exchange failed: %r", exc)

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's figures (a clean stop needs no lease to
        run out); an exchange in flight ends first, so nothing it writes lands after the withdrawal."""
        for t in self.targets:
            t.ledger.on_change = None
        self._stopped = True  # ends the loop even if a cancel is lost (the loop checks it each turn)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._alone_timer is not None:
            self._alone_timer.cancel()
            self._alone_timer = None
        if self._exchange is not None:
            await asyncio.wait([self._exchange], timeout=EXCHANGE_TIMEOUT_S)
        if self._chores:
            await asyncio.gather(*self._chores, return_exceptions=True)
        self._release()
        try:
            async with asyncio.timeout(1.0):
                # UNLINK as a raw command: a cluster pipeline's unlink() is a coroutine, not a queued command.
                await self.client.pipeline(transaction=False).execute_command(
                    "UNLINK", self._own_key).srem(self.members_key, self.id).execute()
        except (RedisError, OSError, TimeoutError):
            pass  # the lease ends it

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        while not self._stopped:
            started = loop.time()
            try:
                if self._stretched(started):
                    self._last_ok_s = self._read_ok_s  # the others' figures are that fresh
                else:
                    async with asyncio.timeout(max(self.interval_s * 4, 0.5)):
                        await self.sync()
                    self._last_ok_s = started
            except (RedisError, OSError, TimeoutError, asyncio.CancelledError) as exc:
                if me is not None and me.cancelling():
                    raise  # a stop: asyncio.timeout can turn a cancel that meets its deadline into TimeoutError
                # Not a stop (a cancelled exchange is a failed one): the loop never ends but by `stop`,
                # or this replica would keep its last view of the others, and its lease, forever.
                if self._last_ok_s is None or started - self._last_ok_s > self.lease_ms / 1000:
                    self._clear()  # the others' figures are older than their lease: fall back to our own
                self._failed(exc)
            if self._on_sync is not None:
                self._on_sync(self.replicas_seen)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.0))

    def _stretched(self, now: float) -> bool:
        """Whether the periodic exchange can skip this interval: the request path's exchanges read
        the others' figures within the last interval, and the last periodic one (lease, membership)
        is less than ``SYNC_STRETCH_INTERVALS`` intervals old."""
        return (bool(self._others) and now - self._read_ok_s < self.interval_s
                and now - self._synced_s < self.interval_s * SYNC_STRETCH_INTERVALS)

    async def sync(self) -> None:
        """The periodic exchange, by the next exchange to start: write all of this replica's
        figures, renew its lease and membership, read the member list and the others' figures,
        set ``peer_*`` (raises RedisError, OSError or TimeoutError)."""
        if self._sync_due is None or self._sync_due.done():
            self._sync_due = asyncio.get_running_loop().create_future()
        due = self._sync_due
        if self._exchange is None:
            self._begin()
        # Shielded: a caller's timeout (the loop's, while Redis is slow) must not cancel the future
        # the exchange will resolve; a later call waits for the same one.
        await asyncio.shield(due)

    def _clear(self) -> None:
        for t in self.targets:
            t.ledger.peer_in_flight = 0
            t.ledger.peer_kv_demand_bytes = t.ledger.peer_outstanding_prefill_s = 0.0
        self.replicas_seen = 1
