"""The gateway over a frozen Redis and on a busy event loop (issue 16), on 127.0.0.1.

A real redis-server that the test SIGSTOPs (always SIGCONTed on the way out), a mock vLLM
backend, the gateway under uvicorn: after a few requests that wait out the index deadline
the breaker opens, requests are as fast as before the freeze and routed without prefix
matches, ``gateway_index_degraded`` reads 1; after SIGCONT the half-open probe closes it
and prefix matches come back.

Latency is compared in pairs, as `bench/faults_probe.py` does: each request whose prompt
the index sees is followed by a control request whose prompt is shorter than one index
block (the gateway never asks the index about it), and what is compared is the median of
the pairs' differences, which the noise of a shared machine moves far less than either
(each pair in a random order, so that no periodic load elsewhere lines up with one kind).
Before the breaker, every such difference was the index deadline or more (~55 ms).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
import pytest
import redis.asyncio as redis

from fleet_config import default_catalog, parse_settings
from prefix_index.redis_defaults import DEFAULT_TIMEOUT_S
from prefix_index.redis_index import RedisPrefixIndex
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, run_gateway, run_mocks
from tests.support.redis_server import frozen, redis_process
from tests.unit.gateway.routing_support import routing_service

pytestmark = [pytest.mark.integration, pytest.mark.redis]

BODY = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "shared prefix " * 400}], "max_tokens": 3}
CONTROL = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}  # < one block
TIMEOUT_S = DEFAULT_TIMEOUT_S  # the gateway's default index deadline
OPEN_S = 0.5
SAMPLES = 30


def timed_post(http: httpx.Client, body: dict = BODY) -> tuple[float, float]:
    """(seconds, x-kappa-ratio) of one request; it must succeed."""
    start = time.perf_counter()
    resp = http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    assert resp.status_code == 200, resp.text
    return elapsed, float(resp.headers["x-kappa-ratio"])


def paired(http: httpx.Client, rnd: random.Random) -> tuple[float, float]:
    """(seconds the index request took more than its control, the index request's x-kappa-ratio)."""
    if rnd.random() < 0.5:
        (indexed, ratio), (control, _) = timed_post(http), timed_post(http, CONTROL)
    else:
        (control, _), (indexed, ratio) = timed_post(http, CONTROL), timed_post(http)
    return indexed - control, ratio


def test_a_frozen_redis_costs_a_few_requests_then_routing_skips_the_index() -> None:
    index = {"backend": "redis", "timeout_s": TIMEOUT_S, "breaker_failures": 3, "breaker_open_s": OPEN_S,
             "breaker_max_open_s": OPEN_S}
    with redis_process() as (url, proc), run_mocks(1) as urls, \
            run_gateway([backend_doc("a", urls[0])], index={**index, "redis_url": url}) as gw:
        poll(lambda: timed_post(gw.http)[1] > 0, "the prompt's prefix to be recorded and matched")
        rnd = random.Random(0)
        normal_s = statistics.median(paired(gw.http, rnd)[0] for _ in range(SAMPLES))
        assert gw.metric("gateway_index_degraded") == 0

        with frozen(proc):
            frozen_at = time.monotonic()
            opening = [timed_post(gw.http) for _ in range(3)]  # each waits out the deadline, then opens it
            assert all(s >= TIMEOUT_S for s, _ in opening)
            assert gw.metric("gateway_index_degraded") == 1
            skipping = [paired(gw.http, rnd) for _ in range(SAMPLES)]
            frozen_s = time.monotonic() - frozen_at
            # As fast as before the freeze (a half-open probe may cost one of them the deadline).
            assert statistics.median(s for s, _ in skipping) < normal_s + 0.015, (normal_s, skipping)
            assert all(ratio == 0 for _, ratio in skipping)  # routed without prefix matches
            skipped = gw.metric("gateway_index_skipped_total", op="match")
            errors = gw.metric("gateway_index_errors_total", op="match")
            assert skipped >= SAMPLES - 3
            assert 3 <= errors <= 3 + frozen_s / OPEN_S + 1  # the opening three, then one probe per interval

        # Redis is back: the next probe closes the breaker, and the recorded prefix matches again.
        poll(lambda: timed_post(gw.http) and gw.metric("gateway_index_degraded") == 0, "the probe to close the breaker")
        assert timed_post(gw.http)[1] > 0


async def test_a_busy_event_loop_counts_no_index_error(redis_url: str, key_prefix: str) -> None:
    doc = {"index": {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "timeout_s": TIMEOUT_S},
           "backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": MOCK_MODEL, "hardware": "h100-sxm"}]}
    settings = parse_settings(doc, default_catalog(), env={})
    index = RedisPrefixIndex.from_url(redis_url, key_prefix=key_prefix, timeout_s=TIMEOUT_S)
    try:
        async with routing_service(settings, index=index) as routing:
            parsed = routing.parse("chat", json.dumps(BODY).encode())
            await routing.plan(parsed)  # connected, script loaded
            loop = asyncio.get_running_loop()
            for _ in range(5):
                loop.call_soon(time.sleep, 0.08)  # CPU-bound work holds the loop 80 ms while the match is out
                plan = await routing.plan(parsed)
                assert plan.index_ok
            assert routing.telemetry.index_errors.labels("match")._value.get() == 0
    finally:
        await index.aclose()
        async with redis.Redis.from_url(redis_url) as client:
            keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
            if keys:
                await client.delete(*keys)
