"""The gateway's errors and their OpenAI-style HTTP form.

    GatewayError                      500 server_error
    ├── BadRequest                    400 invalid_request_error
    ├── Unauthorized                  401 authentication_error (+ WWW-Authenticate: Bearer)
    ├── ModelNotFound                 404 not_found_error
    ├── PayloadTooLarge               413 invalid_request_error
    ├── UnsupportedMediaType          415 invalid_request_error (a Content-Type not JSON, a Content-Encoding it cannot decode)
    ├── NoHealthyBackend              503 service_unavailable_error
    ├── Overloaded                    503 service_unavailable_error (+ Retry-After: an admission cap)
    ├── ShuttingDown                  503 service_unavailable_error (the grace period ended)
    └── UpstreamError                 502 upstream_error
        ├── UpstreamUnavailable       502 connect failure (retry kind ``connect-failure``)
        ├── UpstreamReset             502 closed or reset before the first byte (``reset``)
        ├── UpstreamStatus            the backend's 5xx, before the first byte (``5xx``)
        └── UpstreamTimeout           504 also a TimeoutError (``timeout``)
            └── UpstreamLeftRotation  the backend left rotation before its first byte (moved)

    ClientGone                        (not an HTTP answer: the client disconnected first)

Each `UpstreamError` names its ``retry_kind``, the `fleet_config.RetrySection.retry_on`
condition it falls under; ``moves`` marks the one retried whatever ``retry_on`` says (the
backend left rotation while the request waited for its first byte); ``eject`` marks the
timeouts the backend is to blame for (it hung: silent past the idle timeout, or gone from
rotation while a request waited on it), which count toward its outlier ejection as connect
failures, resets and 5xx do (`gateway.backends.rotation`).

Bodies follow OpenAI's and vLLM ≥ 0.10.1's shape: ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the integer HTTP status (REFERENCE.md §3). The router and the index
know nothing of HTTP: the mapping lives here and in the app's exception handlers only.
"""

from __future__ import annotations

from typing import Any

# Longest client-supplied value echoed in an error message, characters (a 2 MB model name
# must not make a 2 MB error).
MAX_ECHOED_CHARS = 200


class GatewayError(Exception):
    """Base of the gateway's errors; ``status`` and ``error_type`` shape the HTTP answer."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.request_id: str | None = None  # set by the proxy; echoed as x-request-id
        self.counted = False  # its outcome is already in gateway_requests_total (the relay settled it)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.status, self.param)

    def headers(self) -> dict[str, str]:
        """Headers the answer carries besides ``x-request-id`` (``Retry-After``, ``WWW-Authenticate``)."""
        return {}


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    """A missing or wrong ``Authorization: Bearer`` key (admin or client keys configured)."""

    status = 401
    error_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class ModelNotFound(GatewayError):
    status = 404
    error_type = "not_found_error"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class UnsupportedMediaType(GatewayError):
    status = 415
    error_type = "invalid_request_error"


class NoHealthyBackend(GatewayError):
    """No healthy backend serves the request's model (`gateway.routing.RoutingService.plan`)."""

    status = 503
    error_type = "service_unavailable_error"


class Overloaded(GatewayError):
    """An admission cap is reached (`gateway.edge.admission`): retry shortly, here or elsewhere."""

    status = 503
    error_type = "service_unavailable_error"
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class ShuttingDown(GatewayError):
    status = 503
    error_type = "service_unavailable_error"


class UpstreamError(GatewayError):
    status = 502
    error_type = "upstream_error"
    retry_kind = "reset"
    eject = False
    moves = False


class UpstreamUnavailable(UpstreamError):
    """Could not connect to the backend (refused, or no connection within the connect timeout)."""

    retry_kind = "connect-failure"


class UpstreamReset(UpstreamError):
    """The backend closed or reset the connection before the first byte."""

    retry_kind = "reset"


class UpstreamStatus(UpstreamError):
    """The backend answered 5xx before any body was relayed."""

    retry_kind = "5xx"

    def __init__(self, message: str, *, upstream_status: int) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamTimeout(UpstreamError, TimeoutError):
    """No first byte in time, or silence past the idle timeout; ``eject``: the backend hung."""

    status = 504
    error_type = "timeout_error"
    retry_kind = "timeout"

    def __init__(self, message: str, *, eject: bool = False) -> None:
        super().__init__(message)
        self.eject = eject


class UpstreamLeftRotation(UpstreamTimeout):
    """The backend left rotation (failed its health checks, or was ejected) while the request
    waited for its first byte: the request moves to the next backend when its body may be re-sent."""

    moves = True

    def __init__(self, message: str) -> None:
        super().__init__(message, eject=True)


class ClientGone(Exception):
    """The client disconnected before the response began: nothing is sent, nothing retried.

    Args:
        backend: the backend the request was waiting on (for the outcome's label).
        counted: its outcome was already counted (by the relay that noticed).
    """

    def __init__(self, backend: str = "none", *, counted: bool = False) -> None:
        super().__init__(f"the client disconnected while the request waited on backend {backend}")
        self.backend, self.counted = backend, counted


def excerpt(value: object, limit_chars: int = MAX_ECHOED_CHARS) -> str:
    """A client-supplied value as an error message may quote it: at most ``limit_chars``
    characters (then ``…`` and the full length), so an error never echoes megabytes."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit_chars:
        return text
    return f"{text[:limit_chars]}… ({len(text)} characters)"


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}
