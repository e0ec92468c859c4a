"""The measured κ_crit: the gateway fits it from real streamed TTFTs, on a clock it cannot misread.

The backend is a real `mock_vllm.engine.MockEngine` behind a small HTTP face, run in virtual
time: each request is stepped to its first token, and the shared clock — the gateway's
injected clock — is advanced by exactly the engine's modelled TTFT before the first byte is
sent. So the TTFTs the gateway measures are the engine's physics to the nanosecond, whatever
the machine is doing (the wall-clock version of this test failed 3 times in 20 full runs,
when gateway overhead on a busy machine moved a ~44 ms load time by >20%). Everything between
is real: HTTP, the index, the candidates' K_host and T, the clean-sample selection, the fit.
"""

from __future__ import annotations

import itertools
import json
import random
import string
import threading
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet_config import default_catalog
from mock_vllm import tokenizer
from mock_vllm.engine import MockEngine
from mock_vllm.types import EngineConfig
from router import kappa
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
    """Seconds that move only when the upstream says its engine's time moved."""

    def __init__(self) -> None:
        self._now = 1_000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
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
        clock.advance(engine_now[0] - arrival)  # the gateway sees the first byte after the modelled TTFT
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": 1, "total_tokens": out.prompt_tokens + 1,
                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

        async def events() -> AsyncIterator[bytes]:
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
        for i in range(6):
            stream(gw, words(f"cold{i}x", 5_000))  # compute-bound samples, nothing cached
        for i in range(6):
            prefix = words(f"doc{i}y", 5_000)
            stream(gw, prefix)
            stream(gw, words(f"evict{i}a", 5_000))
            stream(gw, words(f"evict{i}b", 5_000))
            stream(gw, prefix + " " + words("q", 40))  # prefix now in the host tier: transfer-bound
        backend = gw.http.get("/v1/kappa/backends").json()["backends"][0]
    assert backend["kappa_fit_samples"] == {"compute": 24, "transfer": 6}  # every cold prompt; the follow-ups
    # Time per new token of a cold 5,000-token prefill (linear FLOPs plus its attention, 39.0 µs)
    # over time per token loaded from the host tier (131,072 B / 15 GB/s = 8.74 µs): 4.467,
    # the linear κ_crit of the profile (4.13) raised by the attention the cold prefills pay.
    per_new_token_s = kappa.prefill_flops(H100_8B.model, 0, 5_000) / 5_000 / H100_8B.c_eff_flops_per_s
    per_loaded_token_s = kappa.b_kv_bytes(H100_8B.model) / H100_8B.link_bytes_per_s
    assert backend["kappa_crit_linear_measured"] == pytest.approx(per_new_token_s / per_loaded_token_s, rel=1e-3)
    assert backend["kappa_crit_linear_measured"] == pytest.approx(H100_8B.kappa_crit_linear, rel=0.1)
