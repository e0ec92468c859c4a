"""aiohttp's errors, in any exchange with a backend, as the gateway's own (STYLE.md B6).

The one module of the edge that names aiohttp's exception classes (tests/test_aiohttp_seam.py
keeps it so). `mapped_errors` has the shape of httpx's ``map_httpcore_exceptions``
(httpx/_transports/default.py): one context manager, used around opening an attempt
(`gateway.upstream.request.open_response`), inside each read of a response after its first
bytes (`gateway.proxy.relay`), and around the health checks and scrapes
(`gateway.backends.backend_set`). The phase decides the error: before the first byte its kind
decides whether the retry policy may send the request elsewhere (``UpstreamError.retry_kind``);
after it, only an SSE error event or a 502 can follow. It lives with the backends: the probes
are there, and the proxy may import that room, not the other way round (DESIGN.md §2).
"""

from __future__ import annotations

import enum
from types import TracebackType

import aiohttp

from gateway.errors import UpstreamError, UpstreamReset, UpstreamTimeout, UpstreamUnavailable


class Phase(enum.Enum):
    """Where in an exchange with a backend an aiohttp error happened (`mapped_errors`)."""

    OPENING = "opening"  # connecting, sending, the response headers, the first body bytes
    STREAM = "stream"  # a streamed response after its first bytes
    BODY = "body"  # a non-streamed response after its first bytes
    PROBE = "probe"  # a health check, model check or metrics scrape


class mapped_errors:  # noqa: N801 -- used as a context manager, named like contextlib's
    """Raise aiohttp's errors inside the block as the gateway's (httpx's ``map_httpcore_exceptions``).

    A class rather than a ``contextlib.contextmanager`` generator: the relay enters it around every
    chunk it reads from a stream, and a generator's set-up costs several times a plain ``__enter__``.

    Args:
        phase: where the block is in the exchange; it decides the error's type and message.
        backend: the backend's id, for the messages of the phases after the first byte.

    Raises:
        UpstreamUnavailable: (``OPENING``, ``PROBE``) no connection: refused, unreachable, or
            none within the connect timeout.
        UpstreamReset: any other aiohttp client error (after the first byte too: the
            connection dropped or the body was malformed).
        UpstreamTimeout: (``STREAM``, ``BODY``) an aiohttp read timeout, a `TimeoutError` like
            the idle timeout's (``eject``: the backend went silent).

    Every other exception passes unchanged, the asyncio timeouts' `TimeoutError` included:
    their bounds and messages are the caller's.
    """

    __slots__ = ("phase", "backend")

    def __init__(self, phase: Phase, backend: str = "") -> None:
        self.phase, self.backend = phase, backend

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, aiohttp.ClientError):
            return False
        raise _mapped(exc, self.phase, self.backend) from exc


def _mapped(exc: aiohttp.ClientError, phase: Phase, backend: str) -> UpstreamError:
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        if phase is Phase.OPENING or phase is Phase.PROBE:
            return UpstreamUnavailable(f"backend unreachable: {exc.__class__.__name__}: {exc}")
        return _after_first_byte(exc, phase, backend)
    if phase is Phase.OPENING:
        return UpstreamReset(f"backend closed the connection before the first byte: {exc.__class__.__name__}")
    if phase is Phase.PROBE:
        return UpstreamReset(f"backend probe failed: {exc.__class__.__name__}: {exc}")
    return _after_first_byte(exc, phase, backend)


def _after_first_byte(exc: aiohttp.ClientError, phase: Phase, backend: str) -> UpstreamError:
    name = exc.__class__.__name__
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors: the relay's idle-timeout path
        return UpstreamTimeout(f"backend {backend} timed out mid-response: {name}", eject=True)
    if phase is Phase.STREAM:
        return UpstreamReset(f"backend {backend} failed mid-stream: {name}")
    return UpstreamReset(f"backend {backend} failed while sending its response: {name}")
