"""Exceptions to OpenAI-shaped HTTP answers: the one mapping every route uses.

A `GatewayError` answers with its own status, type and headers (``Retry-After``,
``WWW-Authenticate``) plus ``x-request-id``; any other exception with an OpenAI-shaped 500 whose log line names the exception's type and stack
but not its message (a library's message may quote the request: no prompt text in logs).
"""

from __future__ import annotations

import logging
import traceback

from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError, error_body

log = logging.getLogger("kappa_gateway.app")


def error_response(exc: Exception, request_id: str | None = None) -> Response:
    """The OpenAI-style answer to an exception raised while serving a request."""
    rid = request_id or getattr(exc, "request_id", None)
    headers = {"x-request-id": rid} if rid else {}
    if isinstance(exc, GatewayError):
        return JSONResponse(exc.body(), status_code=exc.status, headers={**exc.headers(), **headers})
    stack = "".join(traceback.format_tb(exc.__traceback__))
    log.error("unhandled %s while serving a request (message withheld: it may quote the request)\n%s",
              type(exc).__name__, stack)
    return JSONResponse(error_body("Internal server error.", "server_error", 500), status_code=500, headers=headers)
