"""Talking to backends: the session, the headers that go up and come down, and the one place
aiohttp's errors become the gateway's (`mapped_errors`, STYLE.md B6).

The data-plane client is aiohttp: vLLM's production-stack router moved to it from httpx
for throughput (vllm-project/production-stack#569); its connection limit is set from the
config, not left at aiohttp's default of 100 (production-stack#765). Responses are not
decompressed (``auto_decompress=False``) so bytes pass to the client unchanged.

`mapped_errors` has the shape of httpx's ``map_httpcore_exceptions``
(httpx/_transports/default.py): one context manager, used around opening an attempt, inside
each read of a response after its first bytes (`gateway.proxy.relay`) and around the health
checks and scrapes (`gateway.backends.backend_set`). What it raises depends on the phase:
before the first byte the kind of failure decides whether the retry policy may send the
request elsewhere (``UpstreamError.retry_kind``); after it, only an SSE error event or a 502
can follow.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from gateway.errors import UpstreamError, UpstreamReset, UpstreamStatus, UpstreamTimeout, UpstreamUnavailable
from gateway.edge.request_ids import attempt_suffix

# RFC 9110 §7.6.1 connection-specific headers, plus ones the proxy recomputes. `Expect`: the
# gateway already holds the whole body, so a `100-continue` would only make an upstream that
# never sends 100 stall the request (nginx and Envoy drop it too).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
# Set by our own server (uvicorn) or by the gateway itself (x-request-id).
_NOT_RELAYED = HOP_BY_HOP | {"date", "server", "x-request-id"}
_MAX_ERROR_BODY_BYTES = 4096


def make_session(*, connect_timeout_s: float, max_connections_per_backend: int) -> aiohttp.ClientSession:
    """The upstream session: pooled keep-alive connections, no total timeout (long generations run on)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=max_connections_per_backend, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept-Encoding"))


def forward_headers(client_headers: Mapping[str, str], client_host: str | None, *,
                    authorization: bool = True) -> CIMultiDict[str]:
    """The client's headers as the backend should see them.

    Drops the hop-by-hop set, ``Expect``, every header the client's ``Connection`` header names
    (RFC 9110 §7.6.1) and the client's ``X-Request-Id`` (each attempt gets its own,
    `attempt_request_id`); appends the client's address to ``X-Forwarded-For``, as nginx's
    ``$proxy_add_x_forwarded_for`` does. ``Authorization`` passes unless ``authorization`` is
    false (``gateway.forward_authorization``); everything else passes.
    """
    named = {token.strip().lower() for token in client_headers.get("connection", "").split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    forwarded: list[str] = []
    for name, value in client_headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or lower == "x-request-id":
            continue
        if lower == "authorization" and not authorization:
            continue
        if lower == "x-forwarded-for":
            forwarded.append(value)
            continue
        out.add(name, value)
    if client_host:
        forwarded.append(client_host)
    if forwarded:
        out["X-Forwarded-For"] = ", ".join(forwarded)
    return out


def attempt_request_id(request_id: str) -> str:
    """A unique ``X-Request-Id`` for one upstream attempt: the client's id (or the gateway's)
    plus a suffix unique to this call (`gateway.edge.request_ids.attempt_suffix`: the process's random
    tag and a counter), so two requests that share a client id, or a request and its retry, never
    reach a backend under one id (vLLM rejects or confuses duplicates), even from two replicas."""
    return f"{request_id}-{attempt_suffix()}"


def response_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    """Upstream response headers the client should see (hop-by-hop and length dropped)."""
    return {k.lower(): v for k, v in upstream.items() if k.lower() not in _NOT_RELAYED}


@dataclass(frozen=True, slots=True)
class Bound:
    """How long one phase of an attempt may take, s, and whether that bound is the idle
    timeout (missing it means the backend hung, not that it was slow)."""

    seconds: float
    idle: bool


async def open_response(session: aiohttp.ClientSession, url: str, body: bytes, headers: CIMultiDict[str], *,
                        headers_bound: Bound, first_byte_bound: Bound,
                        clock: Callable[[], float]) -> tuple[aiohttp.ClientResponse, bytes, float]:
    """POST ``body``; wait for the status line within ``headers_bound``, then for the first body
    bytes within ``first_byte_bound``.

    Returns:
        The open response (the caller closes or releases it), its first chunk (b"" for an
        empty body) and ``clock()`` when its headers arrived (s). 4xx responses are returned as
        they are: the client's own errors.

    Raises:
        UpstreamUnavailable: no connection (refused, or the connect timeout).
        UpstreamReset: the connection dropped before the first byte.
        UpstreamStatus: the backend answered 5xx (its body was read and released).
        UpstreamTimeout: a bound passed (``eject`` when it was an idle bound).
    """
    resp: aiohttp.ClientResponse | None = None
    bound, what = headers_bound, "response headers"
    try:
        with mapped_errors(Phase.OPENING):
            async with asyncio.timeout(bound.seconds):
                resp = await session.post(url, data=body, headers=headers)
                headers_s = clock()
                if resp.status >= 500:
                    detail = (await resp.content.read(_MAX_ERROR_BODY_BYTES)).decode("utf-8", "replace")
                    resp.release()
                    raise UpstreamStatus(f"backend answered {resp.status}: {detail[:300]}",
                                         upstream_status=resp.status)
            bound, what = first_byte_bound, "first byte"
            async with asyncio.timeout(bound.seconds):
                first = await resp.content.readany()
        return resp, first, headers_s
    except UpstreamStatus:
        raise  # its connection went back to the pool
    except UpstreamError:  # from mapped_errors: no connection (resp is None), or it dropped
        _close(resp)
        raise
    except TimeoutError as exc:
        _close(resp)
        kind = "the idle timeout" if bound.idle else "the request's deadline"
        raise UpstreamTimeout(f"backend sent no {what} within {bound.seconds:.3g}s ({kind})", eject=bound.idle) from exc
    except BaseException:
        _close(resp)
        raise


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


def _close(resp: aiohttp.ClientResponse | None) -> None:
    if resp is not None:
        resp.close()
