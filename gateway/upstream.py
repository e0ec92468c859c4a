"""Talking to backends: open a request, get its first bytes, map aiohttp's errors once.

The data-plane client is aiohttp: vLLM's production-stack router moved to it from httpx
for throughput (vllm-project/production-stack#569); its connection limit is set from the
config, not left at aiohttp's default of 100 (production-stack#765). Responses are not
decompressed (``auto_decompress=False``) so bytes pass to the client unchanged.

Everything up to and including the first body bytes is "before the first byte": a connect
error, a timeout or a 5xx there raises an `UpstreamError` the caller may retry elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from multidict import CIMultiDict

from gateway.errors import UpstreamStatus, UpstreamTimeout, UpstreamUnavailable

# RFC 9110 §7.6.1 connection-specific headers, plus ones the proxy recomputes.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
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


def forward_headers(client_headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop ones; Authorization and the rest pass; X-Request-Id set."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client_headers.items():
        if name.lower() not in HOP_BY_HOP and name.lower() != "x-request-id":
            out.add(name, value)
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    """Upstream response headers the client should see (hop-by-hop and length dropped)."""
    return {k.lower(): v for k, v in upstream.items() if k.lower() not in _NOT_RELAYED}


async def open_response(session: aiohttp.ClientSession, url: str, body: bytes, headers: CIMultiDict[str], *,
                        first_byte_timeout_s: float) -> tuple[aiohttp.ClientResponse, bytes]:
    """POST ``body`` and wait for the status line and the first body bytes.

    Returns:
        The open response (the caller closes or releases it) and its first chunk (b"" for
        an empty body). 4xx responses are returned as they are: the client's own errors.

    Raises:
        UpstreamUnavailable: connect error, or the connection dropped before the first byte.
        UpstreamTimeout: no first byte within ``first_byte_timeout_s``.
        UpstreamStatus: the backend answered 5xx (its body was read and released).
    """
    resp: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(first_byte_timeout_s):
            resp = await session.post(url, data=body, headers=headers)
            if resp.status >= 500:
                detail = (await resp.content.read(_MAX_ERROR_BODY_BYTES)).decode("utf-8", "replace")
                resp.release()
                raise UpstreamStatus(f"backend answered {resp.status}: {detail[:300]}", upstream_status=resp.status)
            first = await resp.content.readany()
        return resp, first
    except TimeoutError as exc:
        _close(resp)
        raise UpstreamTimeout(f"backend gave no first byte within {first_byte_timeout_s:g}s") from exc
    except aiohttp.ClientError as exc:
        _close(resp)
        raise UpstreamUnavailable(f"backend unreachable: {exc.__class__.__name__}: {exc}") from exc
    except BaseException:
        _close(resp)
        raise


def _close(resp: aiohttp.ClientResponse | None) -> None:
    if resp is not None:
        resp.close()
