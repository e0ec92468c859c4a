"""Extra scrapes for the κ_crit fit (`gateway.backends.backend_set.BackendSet.scrape_soon`) against a real
HTTP backend on 127.0.0.1 that serves vLLM's prefill-time histogram and records when it is scraped.

A request's end inside the rate limit's gap used to get no scrape at all, which left a
load-bound request's interval open until the next regular scrape (1 s on the demo), for
requests ending later to spoil; it is now scraped when the gap ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from fleet_config import default_catalog
from fleet_config.settings import parse_settings
from gateway.backends.backend_set import EXTRA_SCRAPE_MIN_GAP_S, BackendSet
from gateway.backends.backend_state import BackendState
from gateway.telemetry.metrics import Telemetry
from tests.integration.gateway_support import backend_doc

pytestmark = pytest.mark.integration

METRICS = """# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{le="+Inf",model_name="m",engine="0"} 0.0
vllm:request_prefill_time_seconds_count{model_name="m",engine="0"} 0.0
vllm:request_prefill_time_seconds_sum{model_name="m",engine="0"} 0.0
"""


async def _ignore_restart(backend_id: str) -> None:
    return None


@asynccontextmanager
async def scraped_backend() -> AsyncIterator[tuple[BackendSet, BackendState, list[float]]]:
    """A started backend set over one backend whose /metrics GETs are timed (loop time) in the list;
    its regular scrapes are a minute apart, so every scrape after the first is an extra one."""
    scrapes_s: list[float] = []

    async def metrics(request: web.Request) -> web.Response:
        scrapes_s.append(asyncio.get_running_loop().time())
        return web.Response(text=METRICS, content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    async with TestServer(app, host="127.0.0.1") as server:
        settings = parse_settings({"backends": [backend_doc("a", str(server.make_url("")).rstrip("/"))]},
                                  default_catalog(), env={})
        entry = settings.backends[0]
        state = BackendState.of(entry, settings.backend_spec(default_catalog(), entry))
        async with aiohttp.ClientSession() as session:
            backends = BackendSet([state], session, Telemetry(CollectorRegistry()), on_restart=_ignore_restart,
                                  health_interval_s=60, scrape_interval_s=60)
            await backends.start()  # probes and scrapes once
            try:
                yield backends, state, scrapes_s
            finally:
                await backends.stop()


async def poll_scrapes(scrapes_s: list[float], n: int) -> None:
    async with asyncio.timeout(5):
        while len(scrapes_s) < n:
            await asyncio.sleep(0.01)  # poll interval


async def test_an_end_inside_the_gap_is_scraped_when_the_gap_ends() -> None:
    async with scraped_backend() as (backends, state, scrapes_s):
        assert len(scrapes_s) == 1 and state.healthy
        backends.scrape_soon(state)  # just after the first scrape: deferred, not dropped
        backends.scrape_soon(state)  # one is due already: nothing more
        await poll_scrapes(scrapes_s, 2)
        assert scrapes_s[1] - scrapes_s[0] >= EXTRA_SCRAPE_MIN_GAP_S * 0.95
        await asyncio.sleep(2 * EXTRA_SCRAPE_MIN_GAP_S)  # the behaviour under test: no third scrape comes
        assert len(scrapes_s) == 2


async def test_an_end_after_the_gap_is_scraped_at_once() -> None:
    async with scraped_backend() as (backends, state, scrapes_s):
        loop = asyncio.get_running_loop()
        await asyncio.sleep(EXTRA_SCRAPE_MIN_GAP_S)  # the behaviour under test: the gap has passed
        asked_s = loop.time()
        backends.scrape_soon(state)
        await poll_scrapes(scrapes_s, 2)
        assert scrapes_s[1] - asked_s < EXTRA_SCRAPE_MIN_GAP_S / 2
