"""The OpenAI-compatible routes: chat completions, completions, models.

The two proxy routes are plain Starlette routes (`proxy_routes`), not FastAPI ones: they
read the raw body and return a raw response, so FastAPI's dependency solving and
request/response handling would be pure per-request overhead on the hot path.
"""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.proxy.handler import serve_proxy
from gateway.routing import Kind
from gateway.routes.deps import State

routes = APIRouter()
_CREATED = int(time.time())


class ProxyEndpoint:
    """An ASGI endpoint for one proxy route (Starlette calls a class instance as ASGI):
    the same `serve_proxy` as the app's fast path."""

    def __init__(self, kind: Kind) -> None:
        self.kind: Kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_proxy(scope, receive, send, self.kind, scope["state"]["gateway"])


proxy_routes = [
    Route("/v1/chat/completions", ProxyEndpoint("chat"), methods=["POST"]),
    Route("/v1/completions", ProxyEndpoint("completion"), methods=["POST"]),
]


@routes.get("/v1/models")
async def models(gw: State) -> dict:
    """The fleet's served models, OpenAI's list shape."""
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": _CREATED, "owned_by": "kappa-gateway",
         "backends": [s.id for s in gw.backends.states if s.entry.model == name]}
        for name in gw.settings.served_models()]}
