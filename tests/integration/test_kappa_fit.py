"""The measured κ_crit: the gateway fits it from real streamed first tokens, on a clock it cannot misread.

The backend is a real `mock_vllm.engine.MockEngine` behind a small HTTP face, run in virtual
time: each request is stepped to its first token; the backend sends its response headers (as
vLLM does once a stream is queued), waits until the gateway has read the shared clock for
them, then advances that clock — the gateway's injected clock — by exactly the engine's
modelled time to first token and sends the first chunk. So the prefill times the gateway
measures are the engine's physics to the nanosecond, whatever the machine is doing (a
wall-clock version failed 3 times in 20 full runs on a busy machine; the demo-traffic test,
`test_kappa_fit_demo.py`, is the wall-clock one). Everything between is real: HTTP, the index,
the candidates' K by tier, the sample selection (`gateway.kappa_feed`), the fit (`router.kappa_fit`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import string
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet_config import default_catalog
from mock_vllm import tokenizer
from mock_vllm.engine import MockEngine
from mock_vllm.types import EngineConfig
from router.cost import BackendSpec
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, run_gateway
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model(MOCK_MODEL), hardware=CATALOG.hw("h100-sxm"))
# 400 blocks × 16 = 6,400 tokens of HBM KV, so a 5,000-token prefix is pushed wholly to the
# host tier by two other prompts.
ENGINE = EngineConfig(host_tier_bytes=16e9, num_gpu_blocks_override=400)


class VirtualClock:
    """Seconds that move only when the upstream says its engine's time moved; counts its reads."""

    def __init__(self) -> None:
        self._now = 1_000.0
        self._lock = threading.Lock()
        self.reads = 0

    def __call__(self) -> float:
        with self._lock:
            self.reads += 1
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def virtual_time_backend(clock: VirtualClock) -> Starlette:
    """A completions endpoint over a MockEngine stepped in virtual time (one request at a time)."""
    engine = MockEngine(H100_8B, ENGINE)
    engine_now = [0.0]
    ids = itertools.count()

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        prompt = tokenizer.encode(body["prompt"])
        rid = str(next(ids))
        arrival = engine_now[0]
        engine.add_request(rid, prompt, max_tokens=1, arrival_s=arrival)
        out = None
        while out is None:
            step = engine.step(engine_now[0])
            engine_now[0] = step.end_s
            out = next((o for o in step.outputs if o.request_id == rid), None)
        ttft_s = engine_now[0] - arrival
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": 1, "total_tokens": out.prompt_tokens + 1,
                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

        async def events() -> AsyncIterator[bytes]:
            # The headers are out; the gateway's next clock read stamps them. Then the prefill runs.
            read = clock.reads
            await until(lambda: clock.reads > read)
            clock.advance(ttft_s)
            chunk = {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: " + json.dumps({"id": rid, "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{engine.stats.num_gpu_blocks}"}} 1\n'
            "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1000\n")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MOCK_MODEL, "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/metrics", metrics),
                             Route("/health", health), Route("/v1/models", models)])


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` on the event loop (the gateway runs in another thread)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the gateway never read the clock for the response headers")
        await asyncio.sleep(0.001)  # poll interval


def words(tag: str, n: int) -> str:
    """``n`` three-letter words (one mock token each), fixed by ``tag``."""
    rng = random.Random(tag)
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3)) for _ in range(n))


def stream(gw, prompt: str) -> None:
    with gw.http.stream("POST", "/v1/completions", json={"model": MOCK_MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "stream": True}) as resp:
        assert resp.status_code == 200
        resp.read()


def test_measured_kappa_crit_matches_the_engines_physics() -> None:
    clock = VirtualClock()
    with serve_in_thread(virtual_time_backend(clock)) as url, \
            run_gateway([backend_doc("a", url, host_tier_gb=16)], clock=clock) as gw:
        for i in range(10):
            stream(gw, words(f"cold{i}x", 1_000 + 500 * i))  # compute-bound samples of 1,000–5,500 tokens
        for i in range(4):
            prefix = words(f"doc{i}y", 5_000)
            stream(gw, prefix)
            stream(gw, words(f"evict{i}a", 5_000))
            stream(gw, words(f"evict{i}b", 5_000))
            stream(gw, prefix + " " + words("q", 40))  # prefix now in the host tier: load-bound
        backend = gw.http.get("/v1/kappa/backends").json()["backends"][0]
    fit = backend["kappa_fit"]
    # every prompt without a usable prefix (10 cold, 4 documents, 8 evictions); the 4 follow-ups
    assert fit["samples"] == {"compute": 22, "load": 4, "kv_pool_load": 0}
    # The engine is its profile (C_eff, 15 GB/s): measured over predicted time is 1 for both rates,
    # and nothing else takes time in virtual time; so the linear κ_crit of the profile, 4.13.
    assert fit["compute_time_ratio"] == pytest.approx(1.0, rel=1e-6)
    assert fit["load_time_ratio"] == pytest.approx(1.0, rel=1e-6)
    assert fit["overhead_s"] == pytest.approx(0.0, abs=1e-9)
    assert backend["kappa_crit_linear_measured"] == pytest.approx(H100_8B.kappa_crit_linear, rel=1e-6)
    low, high = backend["kappa_crit_linear_measured_ci"]
    assert low <= backend["kappa_crit_linear_measured"] <= high and fit["ci_level"] == pytest.approx(0.975 - 0.125)
