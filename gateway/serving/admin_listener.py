"""Liveness apart from admission: a second listener for ``/health``, ``/ready`` and ``/metrics``.

At ``max_client_connections`` the proxy listener answers every new connection 503 (the cap is
decided at accept, before a request's path is known), so a liveness probe on that port would
restart a gateway that is merely busy. A share of the cap reserved for probe paths cannot fix
that: which path a connection will ask for is only known once its head arrived, and a flood of
slow heads would hold the reserved share too. Hence a listener of its own (``gateway.admin_port``),
as Envoy keeps its admin interface and Istio its health port (15021) off the traffic listener:
the same app and lifespan state, the same edge protocol and bounds, its own connection set (it
is not in the proxy's cap; ``ADMIN_MAX_CONNECTIONS`` caps it), and only the operator paths: any
other path is a 404. ``/ready`` on either listener answers 503 ``"saturated": true`` at the cap.

The listener opens after the app's start-up and closes after the proxy listener's drain, so
liveness stays 200 while requests drain. With ``serve --workers N`` every worker binds the
port with ``SO_REUSEPORT`` (Linux), like the proxy port: a probe reaches one of them.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_body
from gateway.serving.connections import EdgeProtocol

ADMIN_PATHS = frozenset(("/health", "/ready", "/metrics"))
ADMIN_MAX_CONNECTIONS = 64  # probes and scrapers: a handful at once
BACKLOG = 128


def admin_only(app: ASGIApp) -> ASGIApp:
    """``app`` for `ADMIN_PATHS`; any other path answers an OpenAI-shaped 404."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ADMIN_PATHS:
            await app(scope, receive, send)
            return
        body = orjson.dumps(error_body("The admin port serves /health, /ready and /metrics only.",
                                       "invalid_request_error", 404))
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    return serve


class AdminListener:
    """The admin listener of one server process (module docstring).

    Args:
        protocol: the proxy listener's protocol class (`gateway.serving.connections.edge_protocol`).
        proxy_connections: the proxy listener's open connections (``uvicorn.Server.server_state``),
            counted by ``/ready`` against the cap.
        host, port: where to listen.
        reuse_port: bind with ``SO_REUSEPORT`` (several worker processes share the port).
    """

    def __init__(self, protocol: type[EdgeProtocol], proxy_connections: set[Any], host: str, port: int, *,
                 reuse_port: bool = False) -> None:
        edge = protocol.edge.model_copy(update={"max_client_connections": ADMIN_MAX_CONNECTIONS})
        self.protocol = type("GatewayAdminProtocol", (protocol,), {
            "edge": edge, "proxy_connections": proxy_connections, "proxy_cap": protocol.edge.max_client_connections})
        self.host, self.port, self.reuse_port = host, port, reuse_port
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[Any] = set()

    async def start(self, config: Any, app_state: dict[str, Any]) -> None:
        """Listen, serving ``config.loaded_app`` restricted to `ADMIN_PATHS`, with ``app_state``
        (the lifespan's) as the proxy listener does.

        Raises:
            OSError: the port cannot be bound.
        """
        from uvicorn.server import ServerState

        state = ServerState()
        self.connections = state.connections
        protocol, app = self.protocol, admin_only(config.loaded_app)

        def make() -> asyncio.Protocol:
            conn = protocol(config=config, server_state=state, app_state=app_state)
            conn.app = app
            return conn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.server = await asyncio.get_running_loop().create_server(make, sock=sock, backlog=BACKLOG)

    def close(self) -> None:
        """Stop listening and close the admin connections (at the end of the server's shutdown)."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.transport.close()
