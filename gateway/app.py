"""The app factory: a new FastAPI app per call, its resources owned by its lifespan."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from gateway.catalog import default_catalog
from gateway.errors import GatewayError, error_body
from gateway.lifespan import open_gateway
from gateway.routes import admin, openai
from gateway.settings import Settings
from gateway.telemetry import Telemetry
from router.errors import NoEligibleBackend
from router.profiles import Catalog


def create_app(settings: Settings, *, catalog: Catalog | None = None, registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.perf_counter) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: validated config (`gateway.settings.load_settings`).
        catalog: model/hardware catalog (default: the shipped one).
        registry: Prometheus registry for this app's metrics (default: a fresh one).
        clock: monotonic seconds, for TTFT/ITL/E2E and decision timing.
    """
    catalog = catalog or default_catalog()
    telemetry = Telemetry(registry or CollectorRegistry())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict]:
        async with open_gateway(settings, catalog, telemetry, clock) as state:
            app.state.gateway = state  # for tests and tools holding the app
            yield {"gateway": state}

    app = FastAPI(title="kappa-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.routes.extend(openai.proxy_routes)
    app.include_router(openai.router)
    app.include_router(admin.router)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        headers = {"x-request-id": exc.request_id} if exc.request_id else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(NoEligibleBackend)
    async def no_backend(request: Request, exc: NoEligibleBackend) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "service_unavailable_error", 503), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    return app
