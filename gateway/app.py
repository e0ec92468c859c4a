"""The app factory: a new FastAPI app per call, its resources owned by its lifespan.

This module is an entry point as well: a server that builds the app from it (``uvicorn
--factory``, through a function giving `create_app` its settings; a ``serve --workers`` worker)
imports the module and then calls the factory, and the module's own imports already load the
compiled hot path, so the build is chosen (`hot_path.select`) by its first statement, not in
`create_app`. Where an entry point that imported it chose first (the command line, the tests'
``conftest.py``), that statement returns the choice made. `create_app` reads the one variable
the gateway takes from the environment outside the config, prometheus-client's multiprocess
directory (``serve --workers``), and passes it down.

The two proxy routes take a fast path (`GatewayApp.__call__`): a POST to
``/v1/chat/completions`` or ``/v1/completions`` goes straight to `gateway.proxy.handler.serve_proxy`,
past Starlette's and FastAPI's middleware stack (server-error, exception, body-limit and
exit-stack layers, each wrapping ``send`` once more per message, a cost measured in
BENCHMARKS.md). The fast path answers the same errors the handlers below do; everything else
goes through FastAPI, where `gateway.edge.catch_all.CatchAll` answers what no handler did (an
OpenAI-shaped 500 that keeps the connection open, not Starlette's plain-text one that closes it).
"""

from __future__ import annotations

import hot_path

hot_path.select()  # before the imports below load any compiled module (module docstring)

import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from fleet_config.catalog import default_catalog
from gateway.edge.catch_all import CatchAll
from gateway.edge.redirects import RelativeRedirects
from gateway.errors import GatewayError, error_body
from gateway.lifespan import open_gateway
from gateway.edge.answers import error_response
from gateway.proxy.handler import serve_proxy
from gateway.routes import admin, openai
from fleet_config.settings import Settings
from gateway.telemetry.metrics import MULTIPROC_DIR_ENV, Telemetry
from router.profiles import Catalog

log = logging.getLogger("kappa_gateway.app")
PROXY_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class GatewayApp(FastAPI):
    """FastAPI, with a fast path for the two proxy routes (see the module docstring)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = PROXY_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST" or "gateway" not in scope.get("state", ()):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        await serve_proxy(scope, receive, send, kind, scope["state"]["gateway"])


def create_app(settings: Settings, *, catalog: Catalog | None = None, registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.perf_counter) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: validated config (`fleet_config.settings.load_settings`).
        catalog: model/hardware catalog (default: the shipped one).
        registry: Prometheus registry for this app's metrics (default: a fresh one).
        clock: monotonic seconds, for TTFT/ITL/E2E and decision timing.

    Reads ``PROMETHEUS_MULTIPROC_DIR`` (`gateway.telemetry.metrics.MULTIPROC_DIR_ENV`): set, the
    app's metrics are prometheus-client's multiprocess ones (``serve --workers``).
    """
    catalog = catalog or default_catalog()
    telemetry = Telemetry(registry or CollectorRegistry(), multiprocess_dir=os.environ.get(MULTIPROC_DIR_ENV))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict]:
        async with open_gateway(settings, catalog, telemetry, clock) as state:
            app.state.gateway = state  # for tests and tools holding the app
            yield {"gateway": state}

    app = GatewayApp(title="kappa-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.routes.extend(openai.proxy_routes)
    app.include_router(openai.routes)
    app.include_router(admin.routes)
    app.include_router(admin.kappa_routes)
    app.add_middleware(CatchAll, answer=error_response)
    app.add_middleware(RelativeRedirects)  # the trailing-slash 307 does not trust Host

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    return app
