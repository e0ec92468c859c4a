"""`PeerLoad.stop` ends its exchange loop even when the cancel is lost.

Seen in a CI run under load: a worker of ``serve --workers 2`` never finished its shutdown. Its
load-exchange task was "cancelling" yet asleep in its loop: the cancel had met the
``asyncio.timeout`` deadline around the exchange and come out as ``TimeoutError`` (Python 3.11's
timeout turns a cancellation it cannot tell from its own into one), which the loop counts as a
failed exchange and goes on. Here the exchange itself converts the cancel, deterministically.
"""

from __future__ import annotations

import asyncio

from dispatch import Target
from fleet_config.catalog import default_catalog
from gateway.replicas.peer_load import PeerLoad
from router.cost import BackendSpec

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


class _NoRedis:
    """Just enough of a client for `stop`'s withdrawal to fail quietly."""

    def register_script(self, script: str) -> None:
        return None

    def pipeline(self, transaction: bool = False) -> "_NoRedis":
        raise OSError("no Redis here")


async def test_stop_ends_the_loop_when_the_exchange_turns_the_cancel_into_a_timeout() -> None:
    peers = PeerLoad(_NoRedis(), "k", [Target("b", SPEC)], sync_interval_s=0.01)  # type: ignore[arg-type]
    entered = asyncio.Event()

    async def sync_that_loses_the_cancel() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError from None  # what asyncio.timeout does when the cancel meets its deadline

    peers.sync = sync_that_loses_the_cancel  # type: ignore[method-assign]
    peers.start()
    await entered.wait()
    async with asyncio.timeout(2.0):  # before: the loop slept on, "cancelling", and stop() never returned
        await peers.stop()
