"""Serving the gateway: uvicorn with a drain before the listener closes, and an end for open streams.

What a load balancer in front (Kubernetes, Envoy, nginx) needs on SIGTERM:

1. ``/ready`` answers 503 at once (``"draining": true``) while the listener stays open and
   requests are still served, for ``shutdown_drain_delay_s``, so the balancer stops sending;
2. then the listener closes (new connections are refused) and requests in flight get up to
   ``graceful_shutdown_timeout_s`` to finish;
3. streams still open then end with an SSE error event (503) and ``data: [DONE]``, and
   requests still waiting answer 503 — a terminated response, never a cut connection;
4. the process exits 0.

With ``gateway.admin_port`` set, a second listener serves ``/health``, ``/ready`` and ``/metrics``
outside the proxy's connection cap (`gateway.serving.admin_listener`); it closes last.

A second SIGINT/SIGTERM skips what is left of the drain; a third forces the exit: open
streams are then cut (the one case a stream may end without an error event) and the process
exits 1, not 0 (`GatewayServer.forced`). uvicorn's
own graceful-shutdown timeout is set past the grace period, so the tails are written before it
would cancel anything (its default waits forever, STYLE.md B7).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from fleet_config import Settings
from gateway.serving.admin_listener import AdminListener
from gateway.serving.connections import edge_protocol
from gateway.serving.logs import redact_log_handlers

log = logging.getLogger("kappa_gateway")

# uvicorn's own deadline sits this far past the grace period: time to write the tails.
TAIL_MARGIN_S = 2.0


def uvicorn_options(settings: Settings) -> dict[str, object]:
    """The `uvicorn.Config` keywords the gateway is served with (also by tests serving it in a
    thread): the edge protocol bounds slow and idle clients and caps connections
    (`gateway.serving.connections`); the keep-alive timeout is the config's; ``proxy_headers`` is off, as
    uvicorn would otherwise replace the peer's address with the last X-Forwarded-For entry, and
    the gateway appends the real peer to that header itself; ``ws`` is off: the gateway offers
    no protocol switch (`gateway.serving.upgrade`)."""
    g = settings.gateway
    return {"proxy_headers": False, "http": edge_protocol(g), "timeout_keep_alive": g.keep_alive_timeout_s,
            "ws": "none"}


class GatewayServer(uvicorn.Server):
    """A uvicorn server that drains before it stops listening (module docstring).

    Args:
        app: the gateway app (`gateway.app.create_app`); its lifespan state is read at shutdown.
        settings: the gateway's settings (drain delay, grace period).
        admin_reuse_port: bind ``gateway.admin_port`` with ``SO_REUSEPORT`` (``serve --workers``).
        config: uvicorn's keywords (host, port, log_level, ...).
    """

    def __init__(self, app: FastAPI, settings: Settings, *, admin_reuse_port: bool = False, **config: object) -> None:
        g = settings.gateway
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=g.graceful_shutdown_timeout_s + TAIL_MARGIN_S,
                                        **uvicorn_options(settings), **config))  # type: ignore[arg-type]
        redact_log_handlers()  # uvicorn.Config has just given its loggers their handlers
        self.app, self.drain_s, self.grace_s = app, g.shutdown_drain_delay_s, g.graceful_shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self.forced = False  # a third signal forced the exit: in-flight work was cut
        self._timers: list[asyncio.TimerHandle] = []
        self.admin: AdminListener | None = None
        if g.admin_port is not None:
            self.admin = AdminListener(self.config.http,  # type: ignore[arg-type]  # edge_protocol(g), uvicorn_options
                                       self.server_state.connections,
                                       str(config.get("host", g.host)), g.admin_port, reuse_port=admin_reuse_port)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.admin is not None:
            try:
                await self.admin.start(self.config, self.lifespan.state)
            except OSError as exc:  # as uvicorn fails a start-up on its own port
                log.error("cannot listen on the admin port %d: %s", self.admin.port, exc.strerror or exc)
                for server in self.servers:
                    server.close()
                await self.lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)

    async def shutdown(self, sockets: list | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self.admin is not None:
                self.admin.close()

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            for timer in self._timers:
                timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Replaces uvicorn's: the first signal starts the drain (and is not re-raised at exit, so
        the process exits 0), the second stops listening now, the third forces the exit."""
        self._signals += 1
        name = signal.Signals(sig).name
        if self._loop is None or self._signals >= 3:
            log.warning("%s again: forcing the exit, cutting what is in flight", name)
            self.should_exit = self.force_exit = self.forced = True
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._begin_drain, name)
        else:
            log.warning("%s again: closing the listener now, skipping the rest of the drain", name)
            self._loop.call_soon_threadsafe(self._close_listener)

    def _begin_drain(self, name: str) -> None:
        gw = getattr(self.app.state, "gateway", None)
        if gw is not None:
            gw.draining = True
        log.warning("%s: draining for %gs (/ready answers 503), then %gs for requests in flight", name, self.drain_s,
                    self.grace_s)
        self._timers.append(self._loop.call_later(self.drain_s, self._close_listener))  # type: ignore[union-attr]

    def _close_listener(self) -> None:
        if self.should_exit:
            return
        for timer in self._timers:
            timer.cancel()
        self.should_exit = True  # uvicorn closes the listener and waits for connections to finish
        self._timers = [self._loop.call_later(self.grace_s, self._end_requests)]  # type: ignore[union-attr]

    def _end_requests(self) -> None:
        gw = getattr(self.app.state, "gateway", None)
        if gw is not None:
            if gw.streams:
                log.warning("grace period over: ending %d open stream(s) with an error event", len(gw.streams))
            gw.stop_requests()
