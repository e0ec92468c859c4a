"""A `gateway.routing.RoutingService` over healthy, never-probed backends, for unit tests."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
from prometheus_client import CollectorRegistry

from fleet_config import Settings, default_catalog
from gateway.backends.backend_set import BackendSet
from gateway.backends.backend_state import BackendState
from gateway.routing import RoutingService
from gateway.telemetry.metrics import Telemetry
from prefix_index import MemoryPrefixIndex, PrefixIndex
from router.calibration import BytesPerToken
from router.policies import build_policy


async def _ignore_restart(backend_id: str) -> None:
    return None


@asynccontextmanager
async def routing_service(settings: Settings, policy: str = "kappa", *, index: PrefixIndex | None = None,
                          seed: int = 0, clock: Callable[[], float] | None = None) -> AsyncIterator[RoutingService]:
    """The routing service the lifespan would build for ``settings`` (every backend healthy;
    nothing probes or scrapes them), on a fresh registry and an in-memory index by default."""
    catalog = default_catalog()
    telemetry = Telemetry(CollectorRegistry())
    states = [BackendState.of(b, settings.backend_spec(catalog, b), healthy=True) for b in settings.backends]
    async with aiohttp.ClientSession() as session:
        backends = BackendSet(states, session, telemetry, on_restart=_ignore_restart, health_interval_s=1,
                              scrape_interval_s=1)
        yield RoutingService(settings, backends, index or MemoryPrefixIndex(), build_policy(policy, {}), telemetry,
                             BytesPerToken(default=settings.index.bytes_per_token), random.Random(seed),
                             **({"clock": clock} if clock is not None else {}))
