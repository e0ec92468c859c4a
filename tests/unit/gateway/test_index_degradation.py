"""The routing service's behaviour when the prefix index fails and answers by turns.

An overloaded Redis times out on some calls and answers others; before the recovery line
waited for steady answers, every turn logged two lines (783 lines in one 3 s benchmark
cell); and while the warning was rate-limited instead, an outage that began soon after a
recovery went unlogged, leaving "reachable again" as the last word on a dead Redis. The
index here is a real MemoryPrefixIndex whose calls fail on a schedule: the test double
stands for Redis, the code under test is RoutingService.
"""

from __future__ import annotations

import logging

import pytest

from fleet_config import default_catalog, parse_settings
from gateway.telemetry.outage import RECOVERY_STABLE_S as INDEX_RECOVERY_STABLE_S
from prefix_index import IndexUnavailable, MemoryPrefixIndex
from tests.unit.gateway.routing_support import routing_service

BODY = b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "' + b"hello " * 200 + b'"}]}'


class FlappingIndex:
    """A memory index whose matches fail when their call number is in ``failing`` (a wrapper:
    the memory index may be compiled, and compiled classes are not subclassed)."""

    def __init__(self, failing: set[int]) -> None:
        self.inner = MemoryPrefixIndex()
        self.failing, self.calls = failing, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def match(self, model, hashes, capacities):
        self.calls += 1
        if self.calls in self.failing:
            raise IndexUnavailable("redis match took longer than 0.05 s")
        return await self.inner.match(model, hashes, capacities)


@pytest.fixture
async def service_and_clock():
    doc = {"backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b", "hardware": "h100-sxm"}]}
    settings = parse_settings(doc, default_catalog(), env={})
    now = [0.0]
    index = FlappingIndex(failing=set(range(1, 41, 2)))  # calls 1, 3, ..., 39 fail
    async with routing_service(settings, index=index, clock=lambda: now[0]) as routing:
        yield routing, index, now


async def test_an_index_failing_by_turns_warns_once_and_says_it_recovered_only_once_it_answers_steadily(
        service_and_clock, caplog) -> None:
    routing, index, now = service_and_clock
    parsed = routing.parse("chat", BODY)
    caplog.set_level(logging.WARNING, logger="kappa_gateway.routing")
    for _ in range(40):
        plan = await routing.plan(parsed)
        assert plan.decision.ranked  # every request is still routed
        now[0] += 0.01
    lines = [r.getMessage() for r in caplog.records]
    # One line for the whole flapping outage, and no "reachable again" while it flaps.
    assert len(lines) == 1, lines
    assert lines[0].startswith("prefix index unavailable (match: redis match took longer than 0.05 s)")
    assert routing.telemetry.index_errors.labels("match")._value.get() == 20

    # Answering steadily for INDEX_RECOVERY_STABLE_S: now it says so, once.
    for _ in range(12):
        await routing.plan(parsed)
        now[0] += INDEX_RECOVERY_STABLE_S / 10
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1:] == ["prefix index reachable again: prefix-aware routing resumed"], lines

    # The next outage warns at once, however soon (the log's last line said the index worked),
    # and says how many errors went unlogged since the last warning.
    caplog.clear()
    index.failing = {index.calls + 1}
    await routing.plan(parsed)
    await routing.plan(parsed)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "20 index errors since the last warning" in lines[0]
