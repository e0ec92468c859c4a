"""The composition root: opens the upstream client, the index, the backend set, in order; closes in reverse.

Every long-lived resource of a gateway is made here, from the validated `fleet_config.Settings`
and what `gateway.app.create_app` passes down (catalog, telemetry, clock), so no module below
reads a file or the environment of its own. Redis is used when the config's ``index.backend``
is ``redis`` (``KAPPA_REDIS_URL`` sets it; one server, a Cluster or a Sentinel set, by the URL's
scheme: `prefix_index.redis_connect`), behind a circuit breaker (`prefix_index.breaker`) whose
state the ``gateway_index_degraded`` gauge reads; otherwise the embedded in-memory index. The KV-event
subscribers (`gateway.backends.kv_events_fleet`, issue 30) start after the backend set and stop before
it, feeding the exact index (`make_engine_index`), closed after them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

import hot_path

from gateway.backends.backend_set import BackendSet
from gateway.backends.backend_state import BackendState
from gateway.backends.engine_tokens import load_model_tokenizers, tokenize_with
from gateway.backends.kv_events_fleet import KvEventsFleet
from gateway.backends.rotation import unhealthy_reason
from gateway.replicas.peer_load import PeerLoad
from gateway.routing import RoutingService
from fleet_config.settings import Settings
from gateway.state import GatewayState
from gateway.telemetry.metrics import REFRESH_INTERVAL_S, Telemetry
from gateway.upstream.request import make_session
from prefix_index import BreakerIndex, CircuitBreaker, MemoryPrefixIndex, PrefixIndex, PrefixIndexError
from prefix_index.engine_index import EngineIndex
from prefix_index.engine_memory import MemoryEngineIndex
from prefix_index.engine_redis import RedisEngineIndex
from prefix_index.redis_connect import RedisConnection, connect, redact_url
from prefix_index.redis_index import RedisPrefixIndex
from router.calibration import BytesPerToken
from router.policies import build_policy
from router.profiles import Catalog

log = logging.getLogger("kappa_gateway")


def make_index(settings: Settings, telemetry: Telemetry, clock: Callable[[], float]) -> PrefixIndex:
    """The configured index: in memory, or Redis behind a circuit breaker on ``clock``."""
    cfg = settings.index
    if cfg.backend == "redis":
        assert cfg.redis_url is not None  # validated by IndexSection
        redis_index = RedisPrefixIndex.from_url(cfg.redis_url, key_prefix=cfg.key_prefix, timeout_s=cfg.timeout_s,
                                                key_ttl_s=cfg.key_ttl_s)
        breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_s, cfg.breaker_max_open_s)
        telemetry.gauge_function(telemetry.index_degraded, lambda: 1.0 if breaker.degraded else 0.0)
        return BreakerIndex(redis_index, breaker, clock)
    return MemoryPrefixIndex()


def make_engine_index(settings: Settings) -> EngineIndex:
    """The exact, event-fed index (issue 30): in Redis beside the approximate one when that is in Redis and
    some backend publishes KV events (shared by the replicas, each batch applied once), else in memory."""
    cfg = settings.index
    if cfg.backend == "redis" and any(b.kv_events is not None for b in settings.backends):
        assert cfg.redis_url is not None  # validated by IndexSection
        return RedisEngineIndex.from_url(cfg.redis_url, key_prefix=cfg.key_prefix, timeout_s=cfg.timeout_s,
                                         key_ttl_s=cfg.key_ttl_s)
    return MemoryEngineIndex()


def open_kv_events(settings: Settings, states: list[BackendState], telemetry: Telemetry,
                   stack: AsyncExitStack) -> KvEventsFleet:
    """The exact index (closed by ``stack``) and the KV-event subscribers feeding it, not started; a backend's
    restart time for them is its last scrape's ``process_start_time_seconds``."""
    engine_index = make_engine_index(settings)
    stack.push_async_callback(engine_index.aclose)
    by_id = {s.id: s for s in states}
    return KvEventsFleet(settings.backends, engine_index, telemetry.kv_events,
                         start_time_of=lambda backend_id: by_id[backend_id].metrics.process_start_time_s)


async def _refresh_gauges(telemetry: Telemetry) -> None:
    try:
        while True:
            telemetry.refresh()
            await asyncio.sleep(REFRESH_INTERVAL_S)
    finally:  # the worker stops (after its drain): its last updates reach the files
        telemetry.refresh()


def _log_ready(settings: Settings, states: list[BackendState]) -> None:
    """The start-up line: how many backends are up, and why each of the others is not."""
    down = [f"{s.id} ({unhealthy_reason(s)})" for s in states if not s.healthy]
    log.log(logging.WARNING if down else logging.INFO,
            "gateway ready: %d/%d backends healthy%s, policy %s, %s index, hot path %s",
            len(states) - len(down), len(states), f"; not up: {', '.join(down)}" if down else "",
            settings.routing.policy, settings.index.backend, hot_path.describe())


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def open_peers(settings: Settings, states: list[BackendState], telemetry: Telemetry,
               index: PrefixIndex) -> tuple[PeerLoad, RedisConnection]:
    """The load exchange with the other replicas on the index's Redis (`gateway.replicas.peer_load`), riding
    in the index's batches where the index is a `RedisPrefixIndex` behind its breaker, and its own client on
    that Redis (any ``redis_url`` form, `prefix_index.redis_connect`), for the caller to close. Not started."""
    cfg = settings.index
    assert cfg.redis_url is not None  # validated by IndexSection
    connection = connect(cfg.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    peers = PeerLoad(connection.client, cfg.key_prefix, states, sync_interval_s=cfg.load_sync_interval_s,
                     read_timeout_s=cfg.timeout_s, on_sync=telemetry.peer_replicas.set,
                     on_error=telemetry.peer_sync_errors.inc)
    if isinstance(index, BreakerIndex) and isinstance(index.index, RedisPrefixIndex):
        peers.ride_with(index.index.carry)  # the exchange rides in the index's batches
    return peers, connection


async def _check_redis(settings: Settings, index: PrefixIndex) -> None:
    """One ``stats`` call at start-up: an unreachable Redis is logged, and the gateway serves without it."""
    try:
        await index.stats()
    except PrefixIndexError as exc:
        log.warning("Redis index at %s unreachable at start-up (%s): serving without prefix matches until "
                    "it answers", redact_url(settings.index.redis_url or ""), exc)


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
        index = make_index(settings, telemetry, clock)
        stack.push_async_callback(index.aclose)
        if settings.index.backend == "redis":
            await _check_redis(settings, index)
        measurement = settings.routing.measured_figures.settings()
        states = [BackendState.of(b, settings.backend_spec(catalog, b), measurement=measurement)
                  for b in settings.backends]
        routing: RoutingService | None = None
        kv_events = open_kv_events(settings, states, telemetry, stack)

        async def forget(backend_id: str) -> None:
            if routing is not None:
                await routing.forget(backend_id)
            kv_events.engine_restarted(backend_id)

        backends = BackendSet(states, probe_session, telemetry, on_restart=forget,
                              health_interval_s=g.health_interval_s, scrape_interval_s=g.scrape_interval_s,
                              outlier_detection=settings.outlier_detection, unhealthy_threshold=g.unhealthy_threshold,
                              healthy_threshold=g.healthy_threshold,
                              healthy_panic_threshold_percent=g.healthy_panic_threshold_percent)
        policy = build_policy(settings.routing.policy, settings.routing.params)
        telemetry.init_requests(((b.id, b.model) for b in settings.backends), policy.name)
        routing = RoutingService(settings, backends, index, policy,
                                 telemetry, BytesPerToken(default=settings.index.bytes_per_token),
                                 random.Random(settings.routing.seed), clock)
        routing.kv_events, routing.tokenize = kv_events, tokenize_with(load_model_tokenizers(settings))
        state = GatewayState(settings, catalog, telemetry, session, index, backends, routing, clock, kv_events=kv_events)
        await backends.start()
        stack.push_async_callback(backends.stop)
        kv_events.start()
        stack.push_async_callback(kv_events.stop)
        if telemetry.multiprocess:  # serve --workers: each worker writes its callback gauges for the others' scrapes
            refresher = asyncio.create_task(_refresh_gauges(telemetry), name="gateway-metrics-refresh")
            stack.push_async_callback(_cancel, refresher)
        if settings.index.backend == "redis" and settings.index.share_load:
            state.peers, peer_redis = open_peers(settings, states, telemetry, index)
            routing.dispatcher.records_at_decision = True
            routing.dispatcher.peer_load = state.peers.refresh
            routing.dispatcher.peer_read_due = state.peers.read_due
            state.peers.start()
            stack.push_async_callback(peer_redis.aclose)
            stack.push_async_callback(state.peers.stop)
        stack.push_async_callback(state.drain)
        _log_ready(settings, states)
        # Everything allocated so far lives as long as the app: keep it out of the cyclic GC's
        # full collections, which otherwise walk it again and again under load.
        gc.freeze()
        state.ready = True
        try:
            yield state
        finally:
            state.ready = False
