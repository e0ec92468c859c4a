"""The OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.proxy import proxy
from gateway.routes.deps import State

router = APIRouter()
_CREATED = int(time.time())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, gw: State) -> Response:
    return await proxy(request, "chat", gw)


@router.post("/v1/completions")
async def completions(request: Request, gw: State) -> Response:
    return await proxy(request, "completion", gw)


@router.get("/v1/models")
async def models(gw: State) -> dict:
    """The fleet's served models, OpenAI's list shape."""
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": _CREATED, "owned_by": "kappa-gateway",
         "backends": [s.id for s in gw.pool.states if s.entry.model == name]}
        for name in gw.settings.served_models()]}
