"""What one load exchange with the other replicas costs and keeps (`gateway.replicas.peer_load`).

Two real `PeerLoad`s on a real redis-server of this test (SIGSTOPped where a test needs Redis
to be slow), real ledgers changed by real tickets. Round trips are counted where they happen:
each command or pipeline redis-py sends on A's connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import ClassVar

import pytest
import redis.asyncio as redis
from redis.asyncio.connection import Connection

from dispatch import Ticket
from fleet_config.catalog import default_catalog
from gateway.replicas.peer_load import SYNC_STRETCH_INTERVALS, PeerLoad
from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S
from router.cost import BackendSpec
from tests.integration.gateway_support import peer_replica, replicas_met
from tests.support.redis_server import frozen, redis_process

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(60)]

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BACKENDS = ("b0", "b1", "b2")
QUIET_S = 30.0  # the periodic exchange runs once at start, then not within a test


class RenewalCountingConnection(Connection):
    """Counts the periodic exchanges it sends: the only ones that pass the replica's id as an
    argument (to renew its membership) besides its key, so the id is twice in the packed command."""

    renewals: ClassVar[dict[str, int]] = {}

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes) else b"".join(command)
        for replica_id in RenewalCountingConnection.renewals:
            if packed.count(replica_id.encode()) >= 2:
                RenewalCountingConnection.renewals[replica_id] += 1
        await super().send_packed_command(command, check_health)


class CountingConnection(Connection):
    """redis-py's own connection, counting what it sends: one per command or pipeline."""

    sends = 0

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


@pytest.fixture()
def server() -> Iterator[tuple[str, object]]:
    with redis_process() as (url, proc):
        yield url, proc


def replica(url: str, *, counted: bool = False, read_timeout_s: float = DEFAULT_TIMEOUT_S,
            sync_interval_s: float = QUIET_S,
            connection_class: type[Connection] | None = None) -> AbstractAsyncContextManager[PeerLoad]:
    return peer_replica(url, "kgtest", SPEC, BACKENDS, connection_class=connection_class or (
        CountingConnection if counted else Connection), sync_interval_s=sync_interval_s, read_timeout_s=read_timeout_s)


async def test_changes_while_a_write_is_in_flight_go_in_one_next_write_and_arrive_in_order(server) -> None:
    """Before, each loop turn with a change sent its own pipeline (20 here, all in flight at
    once on 20 connections); now one exchange is in flight and the changes made meanwhile
    coalesce into the next one."""
    url, proc = server
    async with replica(url, counted=True) as a, replica(url) as b:
        await replicas_met(a, b)
        ledger = a.targets[0].ledger
        tickets = []
        before = CountingConnection.sends
        with frozen(proc):  # Redis answers nothing: the first write stays in flight
            for _ in range(20):
                tickets.append(Ticket(ledger, kv_bytes=1e6, prefill_s=0.01))
                await asyncio.sleep(0)  # a loop turn per change
                await asyncio.sleep(0)
        deadline = time.monotonic() + 10
        while True:  # until B reads A's last figures
            await b.refresh()
            if b.targets[0].ledger.peer_in_flight == 20:
                break
            assert time.monotonic() < deadline, f"B saw {b.targets[0].ledger.peer_in_flight} of A's 20"
        assert CountingConnection.sends - before <= 3  # the write in flight, the one after it (+1 of slack)
        assert b.targets[0].ledger.peer_kv_demand_bytes == 20e6
        for ticket in tickets:
            ticket.finish()
        while b.targets[0].ledger.peer_in_flight != 0:
            assert time.monotonic() < deadline, "B did not see A's requests end"
            await b.refresh()


async def test_a_decision_waits_at_most_the_read_timeout_when_redis_is_slow(server) -> None:
    url, proc = server
    async with replica(url, read_timeout_s=0.05) as a, replica(url) as b:
        await replicas_met(a, b)
        Ticket(b.targets[1].ledger, kv_bytes=0.0, prefill_s=0.0)
        while a.targets[1].ledger.peer_in_flight != 1:
            await a.refresh()
        with frozen(proc):
            started = time.monotonic()
            await a.refresh()  # starts an exchange Redis does not answer
            await a.refresh()  # that exchange is late: the last figures at once
            waited_s = time.monotonic() - started
        assert waited_s < 0.5  # the read timeout (0.05 s), not the exchange's 1 s
        assert a.targets[1].ledger.peer_in_flight == 1  # the last figures stay


async def test_a_write_of_the_changed_figures_keeps_the_lease(server) -> None:
    """Only the changed backends' fields are written per change; the lease (PEXPIRE) comes with
    every write, so a hash that expired under a live replica never comes back without a TTL."""
    url, _ = server
    async with replica(url) as a, replica(url) as b, redis.Redis.from_url(url) as admin:
        await replicas_met(a, b)
        key = f"kgtest:{{peers}}:r:{a.id}"
        assert set(await admin.hkeys(key)) == {x.encode() for x in BACKENDS}
        await admin.delete(key)  # as if A had written nothing for a whole lease
        Ticket(a.targets[2].ledger, kv_bytes=0.0, prefill_s=0.0)
        deadline = time.monotonic() + 10
        while not await admin.exists(key):
            assert time.monotonic() < deadline, "A's change was not written"
            await asyncio.sleep(0.01)  # polling Redis for A's write
        assert await admin.hgetall(key) == {b"b2": b"1 0 0.000000 0 0"}  # pack_figures: five figures
        assert 0 < await admin.pttl(key) <= a.lease_ms
        await a.sync()  # the periodic exchange writes every backend again
        assert set(await admin.hkeys(key)) == {x.encode() for x in BACKENDS}


async def test_the_periodic_exchange_outlives_a_redis_freeze_longer_than_its_timeout(server) -> None:
    """The loop's timeout (0.5 s) used to cancel the future the exchange in flight (1 s timeout)
    would resolve; the next pass awaited that cancelled future, and the loop ended for good: the
    others' last figures stayed forever, and the replicas never met again. Now it lives on, drops
    the others' figures once their lease is over, and meets them again when Redis is back."""
    url, proc = server
    async with replica(url, sync_interval_s=0.05) as a, replica(url, sync_interval_s=0.05) as b:
        await replicas_met(a, b)
        Ticket(b.targets[0].ledger, kv_bytes=0.0, prefill_s=0.0)
        deadline = time.monotonic() + 10
        while a.targets[0].ledger.peer_in_flight != 1:
            assert time.monotonic() < deadline, "A never saw B's request"
            await asyncio.sleep(0.01)  # A's periodic exchange reads it
        with frozen(proc):
            frozen_until = time.monotonic() + 2.5  # past the loop's and the exchange's timeouts, and the 1 s lease
            while time.monotonic() < frozen_until:
                await asyncio.sleep(0.05)  # the behaviour under test: what the loops do while Redis is frozen
            assert not a._task.done() and not b._task.done()  # type: ignore[union-attr]
            assert a.targets[0].ledger.peer_in_flight == 0  # B's figures dropped once their lease ran out
            assert a.errors > 0
        deadline = time.monotonic() + 10
        while a.targets[0].ledger.peer_in_flight != 1 or a.replicas_seen != 2 or b.replicas_seen != 2:
            assert time.monotonic() < deadline, "the replicas did not meet again after the freeze"
            await asyncio.sleep(0.01)  # their periodic exchanges, every 50 ms


async def test_reads_on_the_request_path_stretch_the_periodic_exchange_and_keep_the_lease(server) -> None:
    """Before, a replica ran its periodic exchange (a command of its own) every interval however
    often its decisions read the others; now, while they do, once in SYNC_STRETCH_INTERVALS, which
    still renews its lease (1 s) and membership; idle, every interval again."""
    url, _ = server
    interval_s = 0.05
    async with replica(url, sync_interval_s=interval_s, connection_class=RenewalCountingConnection) as a, \
            replica(url, sync_interval_s=interval_s) as b:
        await replicas_met(a, b)
        RenewalCountingConnection.renewals[a.id] = 0
        busy_s = 3 * a.lease_ms / 1000  # three leases: a lapsed one would show
        end = time.monotonic() + busy_s
        while time.monotonic() < end:
            await a.refresh()  # a decision's read: an exchange of the request path
            await asyncio.sleep(0.01)
        busy = RenewalCountingConnection.renewals[a.id]
        assert busy >= busy_s / (interval_s * SYNC_STRETCH_INTERVALS) - 2  # lease and membership renewed
        assert busy <= busy_s / (interval_s * SYNC_STRETCH_INTERVALS) + 3  # not every interval (60 before)
        assert b.replicas_seen == 2 and a.replicas_seen == 2  # A's lease never ran out
        RenewalCountingConnection.renewals[a.id] = 0
        await asyncio.sleep(1.0)  # idle: nothing reads
        # every interval again: 10 in 1 s here (as at de7ab17), 9 under other test suites' load; stretched, 4
        assert RenewalCountingConnection.renewals[a.id] >= 1.0 / interval_s / 3
