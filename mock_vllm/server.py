"""The mock vLLM backend's HTTP face: vLLM's OpenAI-compatible routes over a `MockEngine`.

Routes (REFERENCE.md §3; wire format in `mock_vllm.openai_api`):

* ``POST /v1/chat/completions``, ``POST /v1/completions``: streamed and not. Prompts are
  tokenised by the model's tokenizer when it has one (its chat template and
  ``tokenizer.json``, as vLLM does), else by the mock's own (`mock_vllm.prompts`); completion
  prompts are a string, a list of one string, token ids, or a list of one list of ids (ids
  bypass the tokenizer). A client that disconnects aborts its request in the engine.
* ``GET /v1/models``, ``GET /health`` (200, empty; 503 once the engine loop has died),
  ``GET /version``, ``GET /metrics`` (the injected registry).
* ``POST /reset_prefix_cache``: 200 with an empty body when the cache was reset; 409 with
  an error body when requests are running and the engine refused (vLLM logs a warning and
  keeps its cache in that case), so a caller knows to retry when idle.
* KV-cache events (``--kv-events-config``): vLLM's ZMQ publisher (`mock_vllm.kv_events`) and its
  fault knobs ``/kappa/faults/kv_events`` (`mock_vllm.kv_event_routes`).
* P/D, vLLM's NixlConnector protocol: ``kv_transfer_params`` on the generation routes
  (`mock_vllm.pd`), the side channel and the link-fault knob (`mock_vllm.pd_routes`), the
  transfer metrics (`mock_vllm.nixl_metrics`).

Every error is vLLM's body ``{"error": {"message", "type", "param", "code"}}``: validation
errors, a body FastAPI cannot parse (vLLM's ``http_exception_handler``), and a chat that the
template cannot render, e.g. tools nested past Python's recursion limit (400, as vLLM's chat
serving answers a failed render).

``X-Request-Id`` is echoed on every response that came with one, and a streamed or
returned ``id`` is ``chatcmpl-<X-Request-Id>`` / ``cmpl-<X-Request-Id>`` (random hex
without the header), as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mock_vllm.driver import EngineClock, EngineDead, EngineDriver, OutputQueue
from mock_vllm.engine import MockEngine, PromptTooLong
from mock_vllm.kv_event_routes import routes as kv_event_routes
from mock_vllm.kv_events import EngineKvEvents, KvEventsConfig
from mock_vllm.metrics import MockVllmMetrics
from mock_vllm.nixl_metrics import NixlMetrics
from mock_vllm.openai_api import (
    ApiError,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    GenerationRequest,
    chat_completion,
    error_body,
    error_event,
    model_list,
    text_completion,
    validation_error,
)
from mock_vllm.pd import FAILED_LOAD_MESSAGE, PdConnector, PdSettings, remote_prefill_params
from mock_vllm.pd_routes import routes as pd_routes
from mock_vllm.prompts import chat_prompt_ids, completion_prompt_ids
from mock_vllm.streaming import sse_events, until_done_or_disconnect, usage_of
from tokenization import EngineTokenizer

MOCK_VERSION = "0.0.0-mock+kappa"


@dataclass(slots=True)
class MockServer:
    """What the routes need, built once per app and handed to them through the lifespan state."""

    engine: MockEngine
    driver: EngineDriver
    served_model_name: str
    registry: CollectorRegistry
    clock: EngineClock
    pd: PdConnector
    kv_events: EngineKvEvents | None = None
    tokenizer: EngineTokenizer | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    def max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        """``max_tokens`` as asked, else the default capped by the room left in the context."""
        if requested is not None:
            return requested
        room = self.engine.max_model_len_tokens - prompt_tokens
        default = self.engine.config.default_max_tokens
        return min(default, room) if room > 0 else default


def _server(request: Request) -> MockServer:
    return request.state.mock


ServerDep = Annotated[MockServer, Depends(_server)]
routes = APIRouter()


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, server: ServerDep) -> Response:
    server.check_model(body.model)
    body.check_n()
    tok = server.tokenizer
    # A Hugging Face tokenizer releases the GIL: encode off the event loop, as vLLM's API server does
    # (its tokenizer runs in an executor), so a 128k-token prompt (~0.2 s) does not stall the others.
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, body, tok) if tok is not None else chat_prompt_ids(body, None)
    return await _generate(server, request, body, prompt_ids, chat=True)


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: ServerDep) -> Response:
    server.check_model(body.model)
    body.check_n()
    tok, vocab = server.tokenizer, server.engine.backend.model.vocab_size
    prompt_ids = (await asyncio.to_thread(completion_prompt_ids, body, tok, vocab) if tok is not None
                  else completion_prompt_ids(body, None, vocab))
    return await _generate(server, request, body, prompt_ids, chat=False)


async def _generate(server: MockServer, request: Request, body: GenerationRequest, prompt_ids: list[int], *,
                    chat: bool) -> Response:
    client_id = request.headers.get("x-request-id")
    response_id = ("chatcmpl-" if chat else "cmpl-") + (client_id or uuid.uuid4().hex)
    engine_id = f"{response_id}-{uuid.uuid4().hex[:8]}" if client_id else response_id
    max_tokens = server.max_tokens(body.requested_max_tokens, len(prompt_ids))
    remote = remote_prefill_params(body.kv_transfer_params)
    model = body.model or server.served_model_name
    hold_kv = bool(body.kv_transfer_params and body.kv_transfer_params.get("do_remote_decode"))
    if body.stream:  # vLLM sends a stream's 200 and headers at once, a P/D decode's before its pull
        writer = ChunkWriter(response_id=response_id, chat=chat, created=int(time.time()), model=model)
        outputs = None if remote is not None else _submit(server, body, prompt_ids, engine_id, max_tokens, hold_kv,
                                                          None, None)
        return StreamingResponse(_stream(server, body, prompt_ids, engine_id, max_tokens, remote, writer, outputs),
                                 media_type="text/event-stream")
    remote_from_block: int | None = None
    arrived_s = None
    if remote is not None:  # P/D decode: pull the KV this engine lacks first (`mock_vllm.pd`)
        arrived_s = server.clock.now_s()
        remote_from_block = await server.pd.pull(prompt_ids, body.cache_salt, remote)
        if remote_from_block is None and server.pd.settings.kv_load_failure_policy == "fail":
            raise ApiError(500, FAILED_LOAD_MESSAGE)
    outputs = _submit(server, body, prompt_ids, engine_id, max_tokens, hold_kv, remote_from_block, arrived_s)
    result = await until_done_or_disconnect(server.driver, engine_id, outputs, request)
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    text, last = result
    build = chat_completion if chat else text_completion
    host, port = request.scope.get("server") or ("127.0.0.1", 0)  # where this mock listens: its side channel
    params = server.pd.transfer_params(engine_id, host, port) if last.kv_held_blocks else None
    return JSONResponse(build(response_id=response_id, created=int(time.time()), model=model, text=text,
                              finish_reason=last.finish_reason or "length", usage_info=usage_of(last),
                              kv_transfer_params=params))


def _submit(server: MockServer, body: GenerationRequest, prompt_ids: list[int], engine_id: str, max_tokens: int,
            hold_kv: bool, remote_from_block: int | None, arrived_s: float | None) -> OutputQueue:
    """Hand a request to the engine. Raises ApiError: 400 for a prompt too long, 500 for a dead engine."""
    try:
        return server.driver.submit(engine_id, prompt_ids, max_tokens=max_tokens, cache_salt=body.cache_salt,
                                    hold_kv=hold_kv, remote_from_block=remote_from_block, arrived_s=arrived_s)
    except PromptTooLong as exc:
        raise ApiError(400, str(exc)) from exc
    except EngineDead as exc:
        raise ApiError(500, str(exc)) from exc


async def _stream(server: MockServer, body: GenerationRequest, prompt_ids: list[int], engine_id: str, max_tokens: int,
                  remote: Any, writer: ChunkWriter, outputs: OutputQueue | None) -> AsyncIterator[str]:
    """A streamed answer (``outputs``: the request already submitted). A P/D decode's pull runs here,
    after the headers, as in vLLM; its failure under ``kv_load_failure_policy: fail`` is an error
    event and ``[DONE]``."""
    if outputs is None:
        arrived_s = server.clock.now_s()
        remote_from_block = await server.pd.pull(prompt_ids, body.cache_salt, remote)
        if remote_from_block is None and server.pd.settings.kv_load_failure_policy == "fail":
            yield error_event(500, FAILED_LOAD_MESSAGE)
            return
        try:
            outputs = _submit(server, body, prompt_ids, engine_id, max_tokens, False, remote_from_block, arrived_s)
        except ApiError as exc:
            yield error_event(exc.status, str(exc))
            return
    async for event in sse_events(server.driver, engine_id, outputs, writer, include_usage=body.include_usage,
                                  continuous_usage=body.continuous_usage):
        yield event


@routes.get("/v1/models")
async def models(server: ServerDep) -> dict[str, Any]:
    model = server.engine.backend.model
    return model_list(served_model_name=server.served_model_name, root=model.hf_id or model.name,
                      created=server.created, max_model_len=server.engine.max_model_len_tokens)


@routes.get("/health")
async def health(server: ServerDep) -> Response:
    return Response(status_code=200 if server.driver.failure is None else 503)


@routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": MOCK_VERSION}


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache(server: ServerDep) -> Response:
    if not server.engine.reset_prefix_cache():
        raise ApiError(409, "Prefix cache not reset: requests are running; retry when the engine is idle.")
    if server.kv_events is not None:  # AllBlocksCleared goes out now, even with the engine idle
        server.kv_events.flush()
    return Response(status_code=200)


@routes.get("/metrics")
async def metrics(server: ServerDep) -> Response:
    # async on purpose: the collector reads engine state, which only the event loop's thread touches.
    return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)


class EchoRequestId:
    """ASGI middleware: copy a request's ``X-Request-Id`` onto its response (vLLM does)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if scope["type"] != "http" or request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status)


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return await _api_error(request, validation_error(exc))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (a body FastAPI could not parse, 404, 405) in vLLM's error body, as
    vLLM's ``http_exception_handler`` answers them, rather than FastAPI's ``{"detail": ...}``."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        headers=exc.headers)


def create_app(engine: MockEngine, *, served_model_name: str, time_scale: float = 1.0,
               registry: CollectorRegistry | None = None, pd: PdSettings | None = None,
               kv_events: KvEventsConfig | None = None, tokenizer: EngineTokenizer | None = None) -> FastAPI:
    """A new mock vLLM server app over ``engine``.

    Args:
        engine: the engine to drive; the app owns it from now on (only its loop steps it).
        served_model_name: the model name clients send and ``/v1/models`` lists.
        time_scale: wall seconds per engine second, > 0 (0.01 = 100× faster than real time).
        registry: where the metrics go; a fresh `CollectorRegistry` when ``None``.
        pd: its P/D settings (`mock_vllm.pd.PdSettings`); ``None``: engine id ``mock``, role
            ``both``, no interconnect (it serves prefills for others, but cannot pull).
        kv_events: vLLM's KV-event publishing (`mock_vllm.kv_events`); ``None`` or inactive: none,
            and the engine computes no vLLM hashes.
        tokenizer: the model's tokenizer (`tokenization.EngineTokenizer`): prompts are tokenised
            as a vLLM engine serving it would; ``None``: the mock's own (`mock_vllm.prompts`).

    The lifespan starts the engine clock, the P/D connector (its HTTP client), the KV-event
    publisher (its sockets bound: a taken port fails the start-up) and the driver task, and stops
    them in reverse on shutdown.
    """
    registry = registry if registry is not None else CollectorRegistry()
    clock = EngineClock(time_scale)
    metrics_ = MockVllmMetrics(registry, engine, model_name=served_model_name, engine_now_s=clock.now_s)
    connector = PdConnector(pd or PdSettings(engine_id="mock"), engine,
                            NixlMetrics(registry, model_name=served_model_name), time_scale)
    events = EngineKvEvents(engine, kv_events) if kv_events is not None and kv_events.active else None
    driver = EngineDriver(engine, clock, metrics_, on_kv_held=connector.on_kv_held,
                          after_step=events.flush if events is not None else None)
    server = MockServer(engine, driver, served_model_name, registry, clock, connector, events, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        clock.start()
        metrics_.mark_started()
        if events is not None:
            await events.publisher.start()
        await connector.start()
        driver_task = asyncio.create_task(server.driver.run(), name="mock-vllm-engine-driver")
        try:
            yield {"mock": server}
        finally:
            driver_task.cancel()
            with suppress(asyncio.CancelledError):
                await driver_task
            if events is not None:
                await events.publisher.close()
            await connector.close()

    app = FastAPI(title="mock-vllm", version=MOCK_VERSION, lifespan=lifespan)
    app.state.engine = engine  # for tests and tools holding the app (only the driver steps it)
    app.state.pd = connector
    app.state.kv_events = events
    for router in (routes, pd_routes, kv_event_routes):
        app.include_router(router)
    for error, handler in ((ApiError, _api_error), (RequestValidationError, _invalid_request),
                           (StarletteHTTPException, _http_error)):
        app.add_exception_handler(error, handler)  # type: ignore[arg-type]
    app.add_middleware(EchoRequestId)
    return app
