"""What the lifespan opens and every route reads: one `GatewayState` per app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.backends import BackendSet
from gateway.routing import RoutingService
from fleet_config.settings import Settings
from gateway.telemetry import Telemetry
from prefix_index import PrefixIndex
from router.profiles import Catalog


@dataclass
class GatewayState:
    """Long-lived resources, owned by the lifespan (opened in order, closed in reverse)."""

    settings: Settings
    catalog: Catalog
    telemetry: Telemetry
    session: aiohttp.ClientSession
    index: PrefixIndex
    backends: BackendSet
    routing: RoutingService
    clock: Callable[[], float] = time.perf_counter
    ready: bool = False
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run off the request path (index records); held here and cancelled at shutdown."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Cancel and await the background work still running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
