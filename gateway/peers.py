"""Gateway replicas share their load: each publishes its ledgers' totals and reads the others'.

Several gateway processes (``serve --workers N``, Kubernetes replicas) in front of one fleet
each charge only the requests they routed; alone, each would see 1/N of every backend's
in-flight count, KV demand and queued prefill seconds, and κ routing would pile work on
backends the others already loaded (measured in the simulator: ``bench/replicas.py``,
``--replica-state local`` vs ``synced``). So, through the Redis the index already uses:

- a replica writes its own per-backend totals to its hash ``P:{peers}:r:<replica id>`` with a
  lease (``PEXPIRE``) whenever a ticket changes them while it knows of another replica (one
  write per event-loop turn, however many changed: `changed`), and every ``sync_interval_s``
  (default 50 ms) off the request path, when it also renews its membership in
  ``P:{peers}:members`` and re-reads the member list (a replica alone writes only then: a new
  one reads figures at most that old, and is seen within that interval);
- every routing decision reads the other members' hashes (`refresh`, one pipelined round trip
  that the dispatcher awaits together with the index match, so a decision costs no extra
  latency; concurrent decisions share one read) and sets each backend ledger's ``peer_*``
  figures to their sum (`dispatch.Ledger`). Measured in the simulator (``bench/replicas.py``),
  reading at each decision matters: Mooncake's bursts arrive within the same millisecond, and
  a 50 ms-old view let two replicas pile a burst onto one backend (κ p90 1.21× one gateway's
  at N = 2, against 0.97× when read per decision);
- a replica that stops (crash, kill -9) stops renewing its lease: its hash expires and its
  charges vanish from the others' view within ``lease_s``; readers drop expired members;
- the chains of requests in flight reach the other replicas through the index itself: with
  peers on, a request's chain is recorded when it is sent, not at its first byte
  (`gateway.attempts`), so another replica routes a question about a document whose prefill
  is still running to where it runs.

Consistency: eventual. A replica sees the others' load as of their last write — about one
round trip old — and its own exactly. A decision waits for the read at most the index's
``timeout_s`` (it runs beside the match, which takes as long); a read that fails or is late
leaves the last figures in place. Redis trouble leaves them in place until their lease would
have run out, then zeroes them (each replica falls back to its own view); failures are
counted in ``gateway_peer_sync_errors_total``. The ``{peers}`` hash tag keeps every key of the
exchange in one Redis Cluster slot, so each pipeline goes to one shard
(``tests/integration/test_redis_cluster.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from dispatch import Target

log = logging.getLogger("kappa_gateway.peers")

DEFAULT_SYNC_INTERVAL_S = 0.05
LEASE_INTERVALS = 20  # a replica's figures outlive it by this many sync intervals (1 s by default)


def replica_id() -> str:
    """This process's id among the replicas: host, pid and a random suffix (a restarted pid differs)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _pack(target: Target) -> str:
    ledger = target.ledger
    return f"{ledger.in_flight} {ledger.kv_demand_bytes:.0f} {ledger.outstanding_prefill_s:.6f}"


class PeerLoad:
    """The exchange (module docstring). Owns nothing but its Redis client.

    Args:
        client: a redis-py asyncio client on the index's Redis: ``Redis`` (one server, or a
            Sentinel set's master) or ``RedisCluster`` (`prefix_index.redis_connect`).
        key_prefix: the index's key prefix.
        targets: this replica's backends (their ledgers are read and their ``peer_*`` set).
        sync_interval_s: seconds between exchanges, > 0.
        read_timeout_s: the longest a decision waits for the others' figures (the index's timeout).
        on_sync: called after each periodic exchange with the replicas seen (itself included).
        on_error: called once per failed write, read or exchange.
    """

    def __init__(self, client: redis.Redis | RedisCluster, key_prefix: str, targets: Sequence[Target], *,
                 sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S, read_timeout_s: float = 0.05,
                 on_sync: Callable[[int], None] | None = None, on_error: Callable[[], None] | None = None) -> None:
        self.client, self.targets = client, list(targets)
        self.read_timeout_s = read_timeout_s
        self._others: list[str] = []  # the other members, as of the last membership read
        self._reading: asyncio.Future[None] | None = None
        self._publish_pending = False
        self.errors = 0
        self.id = replica_id()
        self.interval_s = sync_interval_s
        self.lease_ms = max(int(sync_interval_s * LEASE_INTERVALS * 1000), 1000)
        self.members_key = f"{key_prefix}:{{peers}}:members"
        self._prefix = f"{key_prefix}:{{peers}}:r:"
        self.replicas_seen = 1
        self._on_sync, self._on_error = on_sync, on_error
        self._publishing: set[asyncio.Future[None]] = set()
        self._last_ok_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        for t in self.targets:
            t.ledger.on_change = self.changed
        self._task = asyncio.create_task(self._run(), name="gateway-peer-load")

    # -- on the request path ------------------------------------------------------------------
    def changed(self) -> None:
        """A ticket changed this replica's figures: publish them at the end of this loop turn —
        if another replica is there to read them. Alone, the periodic `sync` keeps them fresh
        (within ``sync_interval_s``) for one that joins, and no request pays for a write."""
        if not self._others:
            return
        if not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_soon(self._publish_now)

    def _publish_now(self) -> None:
        self._publish_pending = False
        task = asyncio.ensure_future(self._publish())
        self._publishing.add(task)
        task.add_done_callback(self._publish_done)

    async def _publish(self) -> None:
        key = self._prefix + self.id
        async with asyncio.timeout(1.0):
            await self.client.pipeline(transaction=False).hset(
                key, mapping={t.id: _pack(t) for t in self.targets}).pexpire(key, self.lease_ms).execute()

    def _publish_done(self, task: asyncio.Future[None]) -> None:
        self._publishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failed(task.exception())

    async def refresh(self) -> None:
        """Read the other replicas' figures now (concurrent callers share one read); never raises,
        waits at most ``read_timeout_s`` (a late or failed read leaves the last figures)."""
        if not self._others:
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read(list(self._others)))
            self._reading.add_done_callback(self._read_done)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                await asyncio.shield(self._reading)
        except Exception:  # noqa: BLE001 -- never the request's failure; counted once, by _read_done
            pass

    def _read_done(self, future: asyncio.Future[None]) -> None:
        self._reading = None
        if not future.cancelled() and future.exception() is not None:
            self._failed(future.exception())

    def _failed(self, exc: BaseException | None) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error()
        log.debug("peer load exchange failed: %r", exc)

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's figures (a clean stop needs no lease to run out)."""
        for t in self.targets:
            t.ledger.on_change = None
        self._stopped = True  # ends the loop even if a cancel is lost (the loop checks it each turn)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            async with asyncio.timeout(1.0):
                # UNLINK as a raw command: a cluster pipeline's unlink() is a coroutine, not a queued command.
                await self.client.pipeline(transaction=False).execute_command(
                    "UNLINK", self._prefix + self.id).srem(self.members_key, self.id).execute()
        except (RedisError, OSError, TimeoutError):
            pass  # the lease ends it

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        while not self._stopped:
            started = loop.time()
            try:
                async with asyncio.timeout(max(self.interval_s * 4, 0.5)):
                    await self.sync()
                self._last_ok_s = started
            except (RedisError, OSError, TimeoutError) as exc:
                if me is not None and me.cancelling():
                    raise  # a stop: asyncio.timeout can turn a cancel that meets its deadline into TimeoutError
                if self._last_ok_s is None or started - self._last_ok_s > self.lease_ms / 1000:
                    self._clear()  # the others' figures are older than their lease: fall back to our own
                self._failed(exc)
            if self._on_sync is not None:
                self._on_sync(self.replicas_seen)
            await asyncio.sleep(max(self.interval_s - (loop.time() - started), 0.0))

    async def sync(self) -> None:
        """The periodic exchange: publish ours, renew membership, read the member list and the
        others' figures, set ``peer_*`` (raises RedisError)."""
        own = {t.id: _pack(t) for t in self.targets}
        key = self._prefix + self.id
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=own).pexpire(key, self.lease_ms).sadd(self.members_key, self.id)
        pipe.smembers(self.members_key)
        *_, members = await pipe.execute()
        others = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
        self._others = [m for m in others if m != self.id]
        await self._read(self._others)

    async def _read(self, others: list[str]) -> None:
        """Read ``others``' figures and set ``peer_*``; drop members whose lease ran out."""
        pipe = self.client.pipeline(transaction=False)
        for member in others:
            pipe.hgetall(self._prefix + member)
        tables = await pipe.execute() if others else []
        sums: dict[str, list[float]] = {t.id: [0, 0.0, 0.0] for t in self.targets}
        gone = []
        for member, table in zip(others, tables, strict=True):
            if not table:
                gone.append(member)
                continue
            for backend, packed in table.items():
                row = sums.get(backend.decode() if isinstance(backend, bytes) else backend)
                if row is None:
                    continue  # a backend this replica's config does not have
                for i, value in enumerate((packed.decode() if isinstance(packed, bytes) else packed).split()):
                    row[i] += float(value)
        if gone:
            self._others = [m for m in self._others if m not in gone]
            await self.client.srem(self.members_key, *gone)
        for t in self.targets:
            in_flight, kv, prefill = sums[t.id]
            t.ledger.peer_in_flight = int(in_flight)
            t.ledger.peer_kv_demand_bytes = kv
            t.ledger.peer_outstanding_prefill_s = prefill
        self.replicas_seen = 1 + len(others) - len(gone)

    def _clear(self) -> None:
        for t in self.targets:
            t.ledger.peer_in_flight = 0
            t.ledger.peer_kv_demand_bytes = t.ledger.peer_outstanding_prefill_s = 0.0
        self.replicas_seen = 1
