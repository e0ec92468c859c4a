"""The load exchange riding in the prefix index's batches (`gateway.replicas.peer_load.PeerLoad.ride_with`).

Replica A has a real `RedisPrefixIndex` whose batches carry its exchanges; replica B exchanges
on its own. Both on a real redis-server of this test (SIGSTOPped where Redis must be slow).
Commands are counted where they leave: each command or pipeline redis-py sends, on A's index
connections and on A's exchange connections separately.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as redis
from redis.asyncio.connection import Connection

from dispatch import Target, Ticket
from fleet_config.catalog import default_catalog
from gateway.replicas.peer_load import CARRY_WAIT_S, PeerLoad
from prefix_index import TierCapacity
from prefix_index.redis_index import RedisPrefixIndex
from router.cost import BackendSpec
from tests.integration.gateway_support import replicas_met
from tests.support.redis_server import frozen, redis_process

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(60)]

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BACKENDS = ("b0", "b1", "b2")
QUIET_S = 30.0  # the periodic exchange runs once at start, then not within a test
MODEL = "llama-3.1-8b"
HASHES = list(range(1, 33))
CAPACITIES = {b: TierCapacity(1000, 0) for b in BACKENDS}


class IndexConnection(Connection):
    sends = 0

    async def send_packed_command(self, command, check_health: bool = True) -> None:  # type: ignore[no-untyped-def]
        IndexConnection.sends += 1
        await super().send_packed_command(command, check_health)


class PeersConnection(Connection):
    sends = 0

    async def send_packed_command(self, command, check_health: bool = True) -> None:  # type: ignore[no-untyped-def]
        PeersConnection.sends += 1
        await super().send_packed_command(command, check_health)


def sends() -> tuple[int, int]:
    return IndexConnection.sends, PeersConnection.sends


@pytest.fixture()
def server() -> Iterator[tuple[str, object]]:
    with redis_process() as (url, proc):
        yield url, proc


@asynccontextmanager
async def client(url: str, connection_class: type[Connection] = Connection) -> AsyncIterator[redis.Redis]:
    pool = redis.ConnectionPool.from_url(url, socket_timeout=1.0, connection_class=connection_class)
    conn = redis.Redis(connection_pool=pool)
    try:
        yield conn
    finally:
        await conn.aclose()
        await pool.aclose()


@asynccontextmanager
async def replica(url: str, *, carried: bool,
                  on_error=None) -> AsyncIterator[tuple[PeerLoad, RedisPrefixIndex | None]]:  # type: ignore[no-untyped-def]
    counted = (IndexConnection, PeersConnection) if carried else (Connection, Connection)  # A's are counted
    async with client(url, counted[0]) as index_client, client(url, counted[1]) as peers_client:
        index = RedisPrefixIndex(index_client, key_prefix="kgtest") if carried else None
        peers = PeerLoad(peers_client, "kgtest", [Target(b, SPEC) for b in BACKENDS], sync_interval_s=QUIET_S,
                         read_timeout_s=0.2, on_error=on_error)
        if index is not None:
            assert peers.ride_with(index.carry)
        peers.start()
        try:
            yield peers, index
        finally:
            await peers.stop()
            if index is not None:
                await index.aclose()


async def decide(peers: PeerLoad, index: RedisPrefixIndex) -> None:
    """What `dispatch.Dispatcher.plan` awaits with a gateway's asyncio.gather: the match, then the read."""

    async def read() -> None:
        await peers.refresh()

    await asyncio.gather(index.match(MODEL, HASHES, CAPACITIES), read())


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)  # polling Redis or the other replica


async def test_a_decisions_read_and_its_turns_changes_ride_in_the_batch_of_its_match(server) -> None:
    url, _ = server
    async with replica(url, carried=True) as (a, index), replica(url, carried=False) as (b, _):
        assert index is not None
        await replicas_met(a, b)
        Ticket(b.targets[0].ledger, kv_bytes=2e6, prefill_s=0.5)  # B writes alone

        async def a_sees_b() -> bool:
            await decide(a, index)
            return a.targets[0].ledger.peer_in_flight == 1

        await until(a_sees_b, "A's carried reads never saw B's request")
        assert a.targets[0].ledger.peer_kv_demand_bytes == 2e6
        # One decision: its match and read are one command, on the index's connection; A's change
        # of the same turn (a charge after its decision) rides in it too.
        before = sends()
        ticket = Ticket(a.targets[2].ledger, kv_bytes=3e6, prefill_s=0.1)
        await decide(a, index)
        assert (sends()[0] - before[0], sends()[1] - before[1]) == (1, 0)

        async def b_sees_a() -> bool:
            await b.refresh()
            return b.targets[2].ledger.peer_in_flight == 1

        await until(b_sees_a, "B never saw A's carried write")
        assert b.targets[2].ledger.peer_kv_demand_bytes == 3e6
        ticket.finish()


async def test_without_a_batch_a_read_goes_alone_in_its_turn_and_a_change_within_the_carry_wait(server) -> None:
    url, _ = server
    async with replica(url, carried=True) as (a, _), replica(url, carried=False) as (b, _):
        await replicas_met(a, b)
        Ticket(b.targets[1].ledger, kv_bytes=0.0, prefill_s=0.0)

        async def a_sees_b() -> bool:
            before = sends()
            await a.refresh()  # a decision without a match (no prefix hashes): no batch to ride in
            assert sends()[0] == before[0]  # nothing on the index's connection
            return a.targets[1].ledger.peer_in_flight == 1

        await until(a_sees_b, "A's read never went alone")
        before = sends()
        Ticket(a.targets[0].ledger, kv_bytes=0.0, prefill_s=0.0)  # a change, no batch in sight
        started = time.monotonic()

        async def b_sees_a() -> bool:
            await b.refresh()
            return b.targets[0].ledger.peer_in_flight == 1

        await until(b_sees_a, "A's change was never written")
        assert time.monotonic() - started < 1.0  # CARRY_WAIT_S (5 ms) then one round trip, not the 30 s sync
        assert CARRY_WAIT_S <= 0.005
        assert sends()[1] - before[1] == 1  # written alone, once


async def test_a_failed_batch_fails_its_rider_the_decision_goes_on_and_the_periodic_exchange_repairs(
        server) -> None:
    url, proc = server
    errors: list[int] = []
    async with replica(url, carried=True, on_error=lambda: errors.append(1)) as (a, index), \
            replica(url, carried=False) as (b, _):  # A's errors: what telemetry's peer_sync_errors counts
        assert index is not None
        await replicas_met(a, b)
        Ticket(a.targets[1].ledger, kv_bytes=1e6, prefill_s=0.0)
        with frozen(proc):  # the batch times out (the index's 50 ms): its rider with it
            started = time.monotonic()
            with pytest.raises(Exception, match="redis"):
                await decide(a, index)
            assert time.monotonic() - started < 1.0
        assert errors == [1]
        # What landed is unknown: the next periodic exchange writes every figure A has again
        # (as when an exchange of its own fails), and B sees them.
        Ticket(a.targets[2].ledger, kv_bytes=0.0, prefill_s=0.0)
        await a.sync()

        async def b_sees_both() -> bool:
            await b.refresh()
            return (b.targets[1].ledger.peer_in_flight, b.targets[2].ledger.peer_in_flight) == (1, 1)

        await until(b_sees_both, "A's figures were not all written after the failure")
