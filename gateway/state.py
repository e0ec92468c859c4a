"""What the lifespan opens and every route reads: one `GatewayState` per app.

It also carries the shutdown state the serving process drives (`gateway.serving.server`): ``draining``
(``/ready`` answers 503 while the listener stays open), and `stop_requests`, which ends what is
still in flight when the grace period runs out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.edge.access_log import AccessLog
from gateway.edge.admission import Admission
from gateway.edge.auth import KeyCheck
from gateway.backends.backend_set import BackendSet
from gateway.backends.kv_events_fleet import KvEventsFleet
from gateway.replicas.peer_load import PeerLoad
from gateway.routing import RoutingService
from fleet_config.settings import Settings
from gateway.telemetry.metrics import Telemetry
from prefix_index import PrefixIndex
from router.profiles import Catalog


@dataclass(repr=False)
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
    kv_events: KvEventsFleet | None = field(default=None, kw_only=True)  # KV-event subscribers, exact index (issue 30)
    keys: KeyCheck = field(init=False)
    admission: Admission = field(init=False)
    access_log: AccessLog = field(init=False)
    peers: PeerLoad | None = None  # the load exchange with other replicas (Redis index only)
    ready: bool = False
    draining: bool = False  # SIGTERM seen: /ready answers 503 so load balancers stop sending
    streams: set[Any] = field(default_factory=set)  # open stream relays (`gateway.proxy.relay.Relay`)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _stopping: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        g = self.settings.gateway
        self.keys = KeyCheck(g)
        self.admission = Admission(g.max_in_flight_requests, g.max_in_flight_body_bytes)
        self.access_log = AccessLog(g.access_log, g.access_log_format == "json")

    def __repr__(self) -> str:  # uvicorn's trace log prints the request scope's state once per request
        return (f"GatewayState(backends={len(self.backends.states)}, ready={self.ready}, draining={self.draining}, "
                f"streams={len(self.streams)})")

    def stopping_signal(self) -> asyncio.Future[None]:
        """A future that resolves when the grace period ends (`stop_requests`)."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    def stop_requests(self) -> None:
        """The grace period is over: requests still waiting answer 503, and streams still open
        end with an SSE error event and ``[DONE]`` (not a cut connection)."""
        signal = self.stopping_signal()
        if not signal.done():
            signal.set_result(None)
        for relay in list(self.streams):
            relay.stop()

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
