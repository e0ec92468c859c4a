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
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

from gateway.errors import UpstreamError, UpstreamReset, UpstreamTimeout, UpstreamUnavailable


class Phase(enum.Enum):
    """Where in an exchange with a backend an aiohttp error happened (`mapped_errors`)."""

    OPENING = "opening"  # connecting, sending, the response headers, the first body bytes
    STREAM = "stream"  # a streamed response after its first bytes
    BODY = "body"  # a non-streamed response after its first bytes
    PROBE = "probe"  # a health check, model check or metrics scrape


@contextmanager
def mapped_errors(phase: Phase, backend: str = "") -> Iterator[None]:
    """Raise aiohttp's errors inside the block as the gateway's (httpx's ``map_httpcore_exceptions``).

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
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        if phase is Phase.OPENING or phase is Phase.PROBE:
            raise UpstreamUnavailable(f"backend unreachable: {exc.__class__.__name__}: {exc}") from exc
        raise _after_first_byte(exc, phase, backend) from exc
    except aiohttp.ClientError as exc:
        if phase is Phase.OPENING:
            raise UpstreamReset(f"backend closed the connection before the first byte: {exc.__class__.__name__}") \
                from exc
        if phase is Phase.PROBE:
            raise UpstreamReset(f"backend probe failed: {exc.__class__.__name__}: {exc}") from exc
        raise _after_first_byte(exc, phase, backend) from exc


def _after_first_byte(exc: aiohttp.ClientError, phase: Phase, backend: str) -> UpstreamError:
    name = exc.__class__.__name__
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors: the relay's idle-timeout path
        return UpstreamTimeout(f"backend {backend} timed out mid-response: {name}", eject=True)
    if phase is Phase.STREAM:
        return UpstreamReset(f"backend {backend} failed mid-stream: {name}")
    return UpstreamReset(f"backend {backend} failed while sending its response: {name}")
