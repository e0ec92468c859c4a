"""The OpenAI-compatible routes: chat completions, completions, models.

The two proxy routes are plain Starlette routes (`proxy_routes`), not FastAPI ones: they
read the raw body and return a raw response, so FastAPI's dependency solving and
request/response handling would be pure per-request overhead on the hot path.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.proxy import proxy
from gateway.routes.deps import State

router = APIRouter()
_CREATED = int(time.time())


async def chat_completions(request: Request) -> Response:
    return await proxy(request, "chat", request.state.gateway)


async def completions(request: Request) -> Response:
    return await proxy(request, "completion", request.state.gateway)


proxy_routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]


@router.get("/v1/models")
async def models(gw: State) -> dict:
    """The fleet's served models, OpenAI's list shape."""
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": _CREATED, "owned_by": "kappa-gateway",
         "backends": [s.id for s in gw.backends.states if s.entry.model == name]}
        for name in gw.settings.served_models()]}
