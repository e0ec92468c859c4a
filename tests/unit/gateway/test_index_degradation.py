"""The routing service's behaviour when the prefix index fails and answers by turns.

An overloaded Redis times out on some calls and answers others; before the warning was
rate-limited, every turn logged two lines (783 lines in one 3 s benchmark cell). The
index here is a real MemoryPrefixIndex whose calls fail on a schedule: the test double
stands for Redis, the code under test is RoutingService.
"""

from __future__ import annotations

import logging
import random

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from gateway.backends import BackendSet, BackendState
from gateway.routing import INDEX_WARNING_INTERVAL_S, RoutingService
from fleet_config.settings import parse_settings
from gateway.telemetry import Telemetry
from prefix_index import IndexUnavailable, MemoryPrefixIndex
from router.calibration import BytesPerToken
from router.policies import build_policy

BODY = b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "' + b"hello " * 200 + b'"}]}'


class FlappingIndex(MemoryPrefixIndex):
    """Fails the calls whose number is in ``failing``."""

    def __init__(self, failing: set[int]) -> None:
        super().__init__()
        self.failing, self.calls = failing, 0

    async def match(self, model, hashes, capacities):  # type: ignore[override]
        self.calls += 1
        if self.calls in self.failing:
            raise IndexUnavailable("redis match took longer than 0.05 s")
        return await super().match(model, hashes, capacities)


@pytest.fixture
async def service_and_clock():
    catalog = default_catalog()
    doc = {"backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b", "hardware": "h100-sxm"}]}
    settings = parse_settings(doc, catalog, env={})
    telemetry = Telemetry(CollectorRegistry())
    states = [BackendState.of(b, settings.backend_spec(catalog, b), healthy=True) for b in settings.backends]
    now = [0.0]
    async with aiohttp.ClientSession() as session:
        async def forget(backend_id: str) -> None:
            return None

        backends = BackendSet(states, session, telemetry, on_restart=forget, health_interval_s=1, scrape_interval_s=1)

        def make(index: MemoryPrefixIndex) -> RoutingService:
            return RoutingService(settings, backends, index, build_policy("kappa", {}), telemetry,
                                  BytesPerToken(default=4.0), random.Random(0), clock=lambda: now[0])
        yield make, now


async def test_an_index_failing_by_turns_warns_once_per_interval(service_and_clock, caplog) -> None:
    make, now = service_and_clock
    index = FlappingIndex(failing=set(range(1, 41, 2)))  # calls 1, 3, ..., 39 fail
    routing = make(index)
    parsed = routing.parse("chat", BODY)
    caplog.set_level(logging.WARNING, logger="kappa_gateway.routing")
    for _ in range(40):
        plan = await routing.plan(parsed)
        assert plan.decision.ranked  # every request is still routed
        now[0] += 0.01
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("prefix index unavailable (match: redis match took longer than 0.05 s)")
    assert lines[1] == "prefix index reachable again: prefix-aware routing resumed"
    assert routing.telemetry.index_errors.labels("match")._value.get() == 20

    # After the interval, the next outage warns again and says how many errors it skipped.
    caplog.clear()
    now[0] += INDEX_WARNING_INTERVAL_S
    index.failing = {index.calls + 1}
    await routing.plan(parsed)
    await routing.plan(parsed)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "20 index errors since the last warning" in lines[0]
