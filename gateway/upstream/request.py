"""Talking to backends: the session, the headers that go up and come down, one attempt's opening.

The data-plane client is aiohttp: vLLM's production-stack router moved to it from httpx
for throughput (vllm-project/production-stack#569); its connection limit is set from the
config, not left at aiohttp's default of 100 (production-stack#765). Responses are not
decompressed (``auto_decompress=False``) so bytes pass to the client unchanged.

Everything up to and including the first body bytes is "before the first byte": a failure
there raises an `UpstreamError` whose ``retry_kind`` says whether the retry policy may send
the request elsewhere. aiohttp's errors become those in one place, the backends' room
(`gateway.upstream.errors.mapped_errors`, STYLE.md B6), which the health checks use too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from gateway.edge.request_ids import attempt_suffix
from gateway.errors import UpstreamError, UpstreamStatus, UpstreamTimeout
from gateway.upstream.engine_errors import says_request_is_bad
from gateway.upstream.errors import Phase, mapped_errors

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
        they are: the client's own errors; so is a 5xx whose body says the request is bad
        (`gateway.upstream.engine_errors`), its first chunk then up to its first 4 kB.

    Raises:
        UpstreamUnavailable: no connection (refused, or the connect timeout).
        UpstreamReset: the connection dropped before the first byte.
        UpstreamStatus: the backend answered another 5xx (its body was read and released).
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
                    start = await _read_up_to(resp, _MAX_ERROR_BODY_BYTES)
                    if says_request_is_bad(start):
                        return resp, start, headers_s  # the engine blames the request: relayed as it is
                    resp.release()
                    raise UpstreamStatus(f"backend answered {resp.status}: {start.decode('utf-8', 'replace')[:300]}",
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


async def _read_up_to(resp: aiohttp.ClientResponse, limit_bytes: int) -> bytes:
    """The body's first ``limit_bytes`` (fewer at its end), however the backend cut it into writes."""
    chunks: list[bytes] = []
    size = 0
    while size < limit_bytes:
        chunk = await resp.content.read(limit_bytes - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _close(resp: aiohttp.ClientResponse | None) -> None:
    if resp is not None:
        resp.close()
