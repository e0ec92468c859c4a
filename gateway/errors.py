"""The gateway's errors and their OpenAI-style HTTP form.

    GatewayError                      500 server_error
    ├── BadRequest                    400 invalid_request_error
    ├── ModelNotFound                 404 not_found_error
    ├── PayloadTooLarge               413 invalid_request_error
    ├── NoHealthyBackend              503 service_unavailable_error
    └── UpstreamError                 502 upstream_error
        ├── UpstreamUnavailable       502 (connect error, reset before the first byte)
        ├── UpstreamStatus            the backend's 5xx, before the first byte
        └── UpstreamTimeout           504 (also a TimeoutError)

Bodies follow OpenAI's and vLLM ≥ 0.10.1's shape: ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the integer HTTP status (REFERENCE.md §3). The router and the index
know nothing of HTTP: the mapping lives here and in the app's exception handlers only.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base of the gateway's errors; ``status`` and ``error_type`` shape the HTTP answer."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.request_id: str | None = None  # set by the proxy; echoed as x-request-id

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.status, self.param)


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "not_found_error"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class NoHealthyBackend(GatewayError):
    status = 503
    error_type = "service_unavailable_error"


class UpstreamError(GatewayError):
    status = 502
    error_type = "upstream_error"


class UpstreamUnavailable(UpstreamError):
    """Could not connect to the backend, or it closed before the first byte."""


class UpstreamStatus(UpstreamError):
    """The backend answered 5xx before any body was relayed (retryable once elsewhere)."""

    def __init__(self, message: str, *, upstream_status: int) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamTimeout(UpstreamError, TimeoutError):
    status = 504
    error_type = "timeout_error"


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}
