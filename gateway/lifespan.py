"""The composition root: opens the upstream client, the index, the backend set, in order; closes in reverse.

Redis is used when the config's ``index.backend`` is ``redis`` (``KAPPA_REDIS_URL`` sets it);
otherwise the embedded in-memory index.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

from gateway.backends import BackendSet, BackendState
from gateway.routing import RoutingService
from fleet_config.settings import Settings
from gateway.state import GatewayState
from gateway.telemetry import Telemetry
from gateway.upstream import make_session
from prefix_index import MemoryPrefixIndex, PrefixIndex, PrefixIndexError, RedisPrefixIndex
from router.calibration import BytesPerToken
from router.policies import build_policy
from router.profiles import Catalog

log = logging.getLogger("kappa_gateway")


def make_index(settings: Settings) -> PrefixIndex:
    cfg = settings.index
    if cfg.backend == "redis":
        assert cfg.redis_url is not None  # validated by IndexSection
        return RedisPrefixIndex.from_url(cfg.redis_url, key_prefix=cfg.key_prefix, timeout_s=cfg.timeout_s)
    return MemoryPrefixIndex()


@asynccontextmanager
async def open_gateway(settings: Settings, catalog: Catalog, telemetry: Telemetry,
                       clock: Callable[[], float] = time.perf_counter) -> AsyncIterator[GatewayState]:
    """Open every long-lived resource and yield the state; close them all in reverse on exit."""
    g = settings.gateway
    async with AsyncExitStack() as stack:
        session = make_session(connect_timeout_s=g.upstream_connect_timeout_s,
                               max_connections_per_backend=g.max_connections_per_backend)
        stack.push_async_callback(session.close)
        probe_session = aiohttp.ClientSession()
        stack.push_async_callback(probe_session.close)
        index = make_index(settings)
        stack.push_async_callback(index.aclose)
        if settings.index.backend == "redis":
            try:
                await index.stats()
            except PrefixIndexError as exc:
                log.warning("Redis index at %s unreachable at start-up (%s): serving without prefix matches until "
                            "it answers", settings.index.redis_url, exc)
        states = [BackendState.of(b, settings.backend_spec(catalog, b)) for b in settings.backends]
        routing: RoutingService | None = None

        async def forget(backend_id: str) -> None:
            if routing is not None:
                await routing.forget(backend_id)

        backends = BackendSet(states, probe_session, telemetry, on_restart=forget,
                              health_interval_s=g.health_interval_s, scrape_interval_s=g.scrape_interval_s,
                              outlier_ejection_s=g.outlier_ejection_s)
        policy = build_policy(settings.routing.policy, settings.routing.params)
        telemetry.init_requests(((b.id, b.model) for b in settings.backends), policy.name)
        routing = RoutingService(settings, backends, index, policy,
                                 telemetry, BytesPerToken(default=settings.index.bytes_per_token),
                                 random.Random(settings.routing.seed), clock)
        state = GatewayState(settings, catalog, telemetry, session, index, backends, routing, clock)
        await backends.start()
        stack.push_async_callback(backends.stop)
        stack.push_async_callback(state.drain)
        healthy = sum(s.healthy for s in states)
        log.info("gateway ready: %d/%d backends healthy, policy %s, %s index", healthy, len(states),
                 settings.routing.policy, settings.index.backend)
        # Everything allocated so far lives as long as the app: keep it out of the cyclic GC's
        # full collections, which otherwise walk it again and again under load.
        gc.freeze()
        state.ready = True
        try:
            yield state
        finally:
            state.ready = False
