"""A Redis outage under the replicas' load exchange: one line when it starts, one when it is over, no traceback.

Issue 28, item 5: each outage logged ``Future exception was never retrieved`` tracebacks from the
exchange (asyncio's logger, at garbage collection) and no line of its own, where the index logs one
warning per outage. Two real `PeerLoad`s on a real redis-server that this test freezes (SIGSTOP,
past the exchange's timeout) or kills (SIGKILL, then a new server on the same port), while decisions
read and tickets change the ledgers; the kinds of outage the exchange meets, not one input.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, ExitStack, contextmanager

import pytest

from dispatch import Ticket
from fleet_config.catalog import default_catalog
from gateway.replicas.peer_load import PeerLoad
from router.cost import BackendSpec
from tests.integration.gateway_support import peer_replica, replicas_met
from tests.support.redis_server import free_port, redis_process

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(90)]

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
STABLE_S = 0.3  # the replicas' recovery line after this long of answered exchanges (default 5 s)
OUTAGE_S = 2.5  # past the exchange's 1 s timeout, twice


@contextmanager
def redis_on(port: int) -> Iterator[subprocess.Popen]:
    """A redis-server on ``port`` (`tests.support.redis_server.redis_process`), stopped on the way out."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with redis_process(port) as (_, proc):
        yield proc


def replica(url: str) -> AbstractAsyncContextManager[PeerLoad]:
    return peer_replica(url, "kgtest-outage", SPEC, ("b0", "b1"), sync_interval_s=0.05, recovery_stable_s=STABLE_S)


async def traffic(a: PeerLoad, b: PeerLoad, seconds: float) -> None:
    """Decisions reading the others' figures and tickets changing the ledgers, on both replicas."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for peers in (a, b):
            ticket = Ticket(peers.targets[0].ledger, kv_bytes=1e6, prefill_s=0.01)
            await peers.refresh()
            ticket.finish()
        await asyncio.sleep(0.01)  # a decision every ~10 ms per replica


@pytest.mark.parametrize("kind", ["sigstop", "kill9"])
async def test_an_outage_is_one_line_each_way_and_no_traceback(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    caplog.set_level(logging.ERROR, logger="asyncio")
    caplog.set_level(logging.WARNING, logger="kappa_gateway.peers")  # last: it sets the capture's own level too
    with ExitStack() as servers:  # every server outlives the replicas (their stop must not be an outage)
        proc = servers.enter_context(redis_on(port))
        async with replica(url) as a, replica(url) as b:
            await replicas_met(a, b)
            await traffic(a, b, 0.3)
            errors_before = a.errors + b.errors
            if kind == "sigstop":
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    await traffic(a, b, OUTAGE_S)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                await traffic(a, b, STABLE_S * 4)
            else:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                await traffic(a, b, OUTAGE_S)
                servers.enter_context(redis_on(port))  # a new server on the same port, empty
                await replicas_met(a, b)
                await traffic(a, b, STABLE_S * 4)
            gc.collect()  # a future whose exception nobody retrieved is logged when it is collected
            await asyncio.sleep(0)
            failed = a.errors + b.errors - errors_before
    peers_lines = [r.getMessage() for r in caplog.records if r.name == "kappa_gateway.peers"]
    asyncio_lines = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert failed >= 2  # the outage was seen by both replicas' exchanges
    assert not asyncio_lines, f"asyncio logged: {asyncio_lines}"
    unavailable = [m for m in peers_lines if "load exchange unavailable" in m]
    recovered = [m for m in peers_lines if "load exchange reachable again" in m]
    assert len(unavailable) == 2, "\n".join(peers_lines)  # one per replica, at the outage's start
    assert len(recovered) == 2, peers_lines  # and one per replica once it answered for STABLE_S
    assert "reachable again" in peers_lines[-1]  # the last word says the exchange works
    assert all("Traceback" not in m for m in peers_lines)
