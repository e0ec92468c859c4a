"""A scriptable OpenAI-shaped upstream for failure tests: errors, hangs, mid-stream deaths.

Imports none of the project's packages (STYLE.md B2). Behaviour is set on the `Script`
the test holds; every request received is recorded (body bytes and headers), so a test
can assert what reached which backend.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Script:
    """What the fake does. ``mode``: ok | status | hang | die_mid_stream | slow_stream."""

    model: str = "llama-3.1-8b"  # what /v1/models lists
    mode: str = "ok"
    status: int = 500
    chunks: int = 3
    chunk_delay_s: float = 0.0  # scripted delay between chunks (the behaviour under test)
    process_start_time_s: float | None = 1_000.0  # None: not exported (vLLM's multiprocess mode)
    prefix_cache_queries_tokens: float = 0.0  # vllm:prefix_cache_queries_total
    healthy: bool = True
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when a stream is cut


def _chunk(text: str, finish: str | None = None) -> bytes:
    payload = {"id": "cmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def make_app(script: Script) -> Starlette:
    async def completions(request: Request) -> Response:
        raw = await request.body()
        script.received.append({"body": raw, "headers": dict(request.headers)})
        if script.mode == "status":
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error",
                                           "param": None, "code": script.status}}, status_code=script.status)
        if script.mode == "hang":
            await asyncio.Event().wait()  # never answers: the gateway's timeout is under test
        body = json.loads(raw)
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                           "prompt_tokens_details": {"cached_tokens": 0}}})

        async def events():
            try:
                for i in range(script.chunks):
                    yield _chunk(f"t{i}", "length" if i == script.chunks - 1 else None)
                    if script.mode == "die_mid_stream" and i == 0:
                        raise ConnectionResetError("scripted death mid-stream")
                    if script.chunk_delay_s:
                        await asyncio.sleep(script.chunk_delay_s)  # the scripted delay is the behaviour under test
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                script.cancelled.set()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200 if script.healthy else 503)

    async def metrics(request: Request) -> Response:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{script.model}",engine="0"}} 0\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="100000",engine="0"}} 1\n'
            + ("" if script.process_start_time_s is None else
               f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {script.process_start_time_s}\n")
            + "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="{script.model}",engine="0"}} {script.prefix_cache_queries_tokens}\n'
        )
        return PlainTextResponse(text)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": script.model, "object": "model"}]})

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health), Route("/metrics", metrics),
    ])
