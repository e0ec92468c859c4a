"""Hands a request's engine outputs to its HTTP client: as SSE events, or whole when done.

Outputs arrive on the request's queue from `mock_vllm.driver.EngineDriver`. Outputs that
queue up while a client is slow are merged into one chunk (vLLM's output collector merges
them too). A client that leaves aborts its request in the engine: a streamed response's
generator is cancelled (Starlette listens for ``http.disconnect``) and aborts in its
``finally``; a non-streamed one races its collection against ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from mock_vllm import tokenizer
from mock_vllm.driver import EngineDead, EngineDriver, OutputQueue
from mock_vllm.openai_api import DONE_EVENT, ApiError, ChunkWriter, error_event, usage
from mock_vllm.types import RequestOutput


def usage_of(output: RequestOutput) -> dict[str, Any]:
    """The usage block for a request whose latest output is ``output``."""
    return usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)


async def _next_outputs(outputs: OutputQueue) -> list[RequestOutput]:
    """Wait for the next output, then take any already queued with it (vLLM merges them too)."""
    items = [await outputs.get()]
    while not outputs.empty():
        items.append(outputs.get_nowait())
    for item in items:
        if isinstance(item, BaseException):
            raise item
    return items  # type: ignore[return-value]


def _text(items: list[RequestOutput]) -> str:
    return "".join(tokenizer.token_text(t) for o in items for t in o.new_token_ids)


async def sse_events(driver: EngineDriver, engine_id: str, outputs: OutputQueue, writer: ChunkWriter, *,
                     include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE events for one request; aborts it in the engine if the stream stops early (client gone)."""
    finished = False
    first = True
    try:
        while not finished:
            try:
                items = await _next_outputs(outputs)
            except EngineDead as exc:
                finished = True
                yield error_event(500, str(exc))
                return
            last = items[-1]
            usage_info = usage_of(last) if continuous_usage else None
            if first and writer.chat:
                yield writer.role(usage_info)
            first = False
            finished = last.finished
            text = _text(items)
            if text or finished:
                yield writer.text(text, last.finish_reason if finished else None, usage_info)
        if include_usage:
            yield writer.usage(usage_of(last))
        yield DONE_EVENT
    finally:
        if not finished:
            driver.abort(engine_id)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(outputs: OutputQueue) -> tuple[str, RequestOutput]:
    parts: list[str] = []
    while True:
        items = await _next_outputs(outputs)
        parts.append(_text(items))
        if items[-1].finished:
            return "".join(parts), items[-1]


async def until_done_or_disconnect(driver: EngineDriver, engine_id: str, outputs: OutputQueue,
                                   request: Request) -> tuple[str, RequestOutput] | None:
    """The full text and last output, or ``None`` (request aborted) if the client disconnects first."""
    collect = asyncio.create_task(_collect(outputs))
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            driver.abort(engine_id)
        await asyncio.wait({collect, watch})
    if collect.cancelled():
        return None
    try:
        return collect.result()
    except EngineDead as exc:
        raise ApiError(500, str(exc)) from exc
