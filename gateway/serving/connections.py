"""Client connection hygiene: read timeouts, a connection cap, OpenAI-shaped protocol errors.

uvicorn bounds only the idle time between keep-alive requests: a client that sends half a
request head, or a body one byte a minute, holds its socket (and file descriptor) for ever,
and nothing caps how many sockets clients hold. `edge_protocol` returns uvicorn's httptools
protocol with what nginx and Envoy add (``fleet_config.edge`` has the keys and defaults):

- **head timeout** (nginx ``client_header_timeout``, Envoy ``request_headers_timeout``): from
  the connection's start, or a request's first byte, to the end of its head;
- **body timeout** (nginx ``client_body_timeout``): the longest silence between two reads of a
  request body. Time while the gateway itself paused reading (flow control) does not count;
- on either: a ``408`` OpenAI-shaped answer if none was started, then the connection closes
  (the request being read sees a disconnect);
- **connection cap**: above ``max_client_connections``, idle keep-alive connections are closed
  first, oldest first (as nginx reuses idle connections when it runs out); if none is idle,
  the new connection is answered ``503`` with ``Retry-After`` at once and closed (its socket
  is not held while it would send a head);
- **head size**: a request line and headers over ``max_header_bytes`` (64 KiB, Envoy's
  ``max_request_headers_kb``) get ``431`` and the connection closes, before any of it is routed
  or forwarded;
- a malformed request head is answered with an OpenAI-shaped ``400`` (uvicorn's is plain text);
- **the client leaving** is told to the request at once: ``scope[CLIENT_GONE]`` makes a future
  that ``connection_lost`` resolves (`gateway.proxy.attempts.ClientWatch`), so waiting on a backend
  needs no task reading ASGI messages to notice a disconnect.

The keep-alive timeout is uvicorn's own (``timeout_keep_alive``), set from the config.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from fleet_config.edge import EdgeSettings
from gateway.edge.scope import CLIENT_GONE
from gateway.errors import error_body

RETRY_AFTER_S = 1


def _error_response(status: int, message: str, error_type: str, extra: tuple[bytes, ...] = ()) -> bytes:
    body = orjson.dumps(error_body(message, error_type, status))
    return b"".join((STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), *extra, b"connection: close\r\n\r\n", body))


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the module docstring's bounds; see `edge_protocol`."""

    edge: EdgeSettings  # set on the subclass `edge_protocol` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._idle_since_s = 0.0
        self._head_bytes = 0
        self._refused = False  # answered and closing: the parser's further callbacks are ignored
        self._gone: list[asyncio.Future[None]] = []  # the current request's client_gone futures

    # -- the connection cap ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()
        excess = len(self.connections) - self.edge.max_client_connections
        if excess > 0:
            idle = sorted((c for c in self.connections if isinstance(c, EdgeProtocol) and c is not self and c.idle),
                          key=lambda c: c._idle_since_s)
            for conn in idle[:excess]:
                conn.transport.close()
            if len(idle) < excess:
                self._refuse(503, "The gateway has too many open connections; retry shortly.",
                             "service_unavailable_error", b"retry-after: %d\r\n" % RETRY_AFTER_S)

    @property
    def idle(self) -> bool:
        """Between two requests of a keep-alive connection (uvicorn's keep-alive timer runs)."""
        return self.timeout_keep_alive_task is not None and not self.transport.is_closing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since_s = time.monotonic()
        self._gone.clear()  # the request is answered: its watches were stopped

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        for future in self._gone:
            if not future.done():
                future.set_result(None)
        self._gone.clear()

    # -- the client leaving ------------------------------------------------------------
    def client_gone(self) -> asyncio.Future[None]:
        """A future resolved when the connection is lost (already, if it is): ``scope[CLIENT_GONE]``.

        Reading resumes, as an ASGI ``receive`` would: a paused transport does not see the
        peer's close. Cancel the future to stop watching."""
        future = self.loop.create_future()
        cycle = self.cycle
        if self.transport.is_closing() or (cycle is not None and cycle.disconnected):
            future.set_result(None)
            return future
        if self.flow is not None:
            self.flow.resume_reading()
        self._gone.append(future)
        return future

    # -- read timeouts -------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CLIENT_GONE] = self.client_gone  # type: ignore[literal-required]
        self._head_bytes = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.edge.max_header_bytes and not self._refused:
            self._refuse(431, f"The request line and headers exceed {self.edge.max_header_bytes} bytes.",
                         "invalid_request_error")

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._refused:
            return
        super().on_headers_complete()
        self._arm_body_timer()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        super().on_body(body)
        self._arm_body_timer()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if not self._refused:
            super().on_message_complete()

    def _refuse(self, status: int, message: str, error_type: str, *extra: bytes) -> None:
        """Answer ``status`` now, before any request runs, and close the connection."""
        self._refused = True
        self._cancel_timers()
        if not self.transport.is_closing():
            self.transport.write(_error_response(status, message, error_type, extra))
            self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.edge.client_header_timeout_s, self._read_timed_out, "head")

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self.edge.client_body_timeout_s, self._read_timed_out, "body")

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _read_timed_out(self, phase: str) -> None:
        if phase == "body" and self.flow is not None and self.flow.read_paused:
            self._body_timer = None
            self._arm_body_timer()  # the gateway paused reading: the client is not the slow one
            return
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._refused:
            return
        if cycle is None or not cycle.response_started:
            limit = self.edge.client_header_timeout_s if phase == "head" else self.edge.client_body_timeout_s
            what = "request head" if phase == "head" else "next part of the request body"
            self.transport.write(_error_response(408, f"The {what} did not arrive within {limit:g}s.",
                                                 "invalid_request_error"))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app reading the body sees http.disconnect; its answer goes nowhere
            cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_error_response(400, msg, "invalid_request_error"))
        self.transport.close()


def edge_protocol(edge: EdgeSettings) -> type[EdgeProtocol]:
    """The protocol class uvicorn should serve with (``uvicorn.Config(http=...)``)."""
    return type("GatewayEdgeProtocol", (EdgeProtocol,), {"edge": edge})
