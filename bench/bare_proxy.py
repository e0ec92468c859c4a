"""The baseline for the gateway's overhead: a bare reverse proxy on the gateway's own stack.

uvicorn (uvloop + httptools, as ``kappa-gateway serve`` gets by default) + Starlette routes
+ one aiohttp ``ClientSession`` to one upstream, no routing: the request body goes upstream
byte for byte, a ``text/event-stream`` answer comes back chunk by chunk as it arrives, any
other answer is read whole and returned. Request headers are forwarded minus hop-by-hop
ones, as the gateway does. The client is aiohttp because it was the fastest one measured on
this stack (issue 6). It imports none of the project's packages.

    python bench/bare_proxy.py --upstream http://127.0.0.1:PORT   # prints {"port": N} once bound
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "date", "server"})
GRACEFUL_SHUTDOWN_S = 1.0


def build_app(upstream: str) -> Starlette:
    session: aiohttp.ClientSession | None = None

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal session
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=1024)  # not aiohttp's default of 100
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                        timeout=aiohttp.ClientTimeout(total=None),
                                        skip_auto_headers=("User-Agent", "Accept-Encoding"))
        async with session:
            yield

    async def forward(request: Request) -> Response:
        assert session is not None
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
        resp = await session.post(upstream + request.url.path, data=body, headers=headers)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()
            return StreamingResponse(relay(), status_code=resp.status, headers=out_headers)
        try:
            data = await resp.read()
        finally:
            resp.release()
        return Response(data, status_code=resp.status, headers=out_headers)

    async def health(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    return Starlette(lifespan=lifespan, routes=[
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/health", health),
    ])


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="http://127.0.0.1:PORT of the upstream")
    parser.add_argument("--workers", type=int, default=1, help="processes accepting on the one socket (forked)")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    for _ in range(args.workers - 1):  # before any event loop exists: each child serves the same socket
        if os.fork() == 0:
            ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # stop with the parent
            break
    config = uvicorn.Config(build_app(args.upstream.rstrip("/")), loop="uvloop", http="httptools",
                            access_log=False, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
