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
- **send timeout** (nginx ``send_timeout``): a response write blocked because the client does
  not read may stay blocked ``client_send_timeout_s`` at most; then the connection is aborted
  (the request sees the client gone);
- **``Upgrade``** is ignored (RFC 9110 §7.8): the request is read and answered as plain
  HTTP/1.1, body included (`gateway.serving.upgrade`); ``CONNECT`` gets ``405`` and the
  connection closes. No connection is handed to another protocol, so none leaves these bounds;
- a malformed request head is answered with an OpenAI-shaped ``400`` (uvicorn's is plain text);
- **the client leaving** is told to the request at once: ``scope[CLIENT_GONE]`` makes a future
  that ``connection_lost`` resolves (`gateway.proxy.attempts.ClientWatch`), so waiting on a backend
  needs no task reading ASGI messages to notice a disconnect.

The keep-alive timeout is uvicorn's own (``timeout_keep_alive``), set from the config. So every
state a connection can be in has a bound: its head, its body, a response write, idle keep-alive;
while the app works on a request, the proxy's own deadlines bound it (``upstream_*_timeout_s``).
``scope[CONNECTION_LOAD]`` tells ``/ready`` how many proxy connections are open against the cap.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from fleet_config.edge import EdgeSettings
from gateway.edge.scope import CLIENT_GONE, CONNECTION_LOAD
from gateway.errors import error_body
from gateway.serving.upgrade import plain_head

RETRY_AFTER_S = 1


def _error_response(status: int, message: str, error_type: str, extra: tuple[bytes, ...] = ()) -> bytes:
    body = orjson.dumps(error_body(message, error_type, status))
    return b"".join((STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), *extra, b"connection: close\r\n\r\n", body))


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the module docstring's bounds; see `edge_protocol`."""

    edge: EdgeSettings  # set on the subclass `edge_protocol` makes
    # The proxy listener's connections and cap, when this protocol serves another listener (the admin one).
    proxy_connections: set[Any] | None = None
    proxy_cap = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._upgrade: tuple[bytes, bytes, str, list[tuple[bytes, bytes]]] | None = None  # an ignored upgrade's head
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
        """uvicorn's, but an ``Upgrade`` request goes on as HTTP/1.1 (`_without_upgrade`)."""
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:  # llhttp stopped after the head (gateway.serving.upgrade)
            self._without_upgrade(data[exc.args[0]:])
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    def _without_upgrade(self, rest: bytes) -> None:
        if self._upgrade is None or self._refused:
            return
        method, target, version, headers = self._upgrade
        self._upgrade = None
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's parser
        self.data_received(plain_head(method, target, version, headers) + rest)

    def connection_load(self) -> tuple[int, int]:
        """``(open, cap)``: proxy-listener connections open, not counting the one asking, and
        ``max_client_connections`` (``scope[CONNECTION_LOAD]``, read by ``/ready``)."""
        if self.proxy_connections is None:
            return len(self.connections) - (self in self.connections), self.edge.max_client_connections
        return len(self.proxy_connections), self.proxy_cap

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CLIENT_GONE] = self.client_gone  # type: ignore[literal-required]
        self.scope[CONNECTION_LOAD] = self.connection_load  # type: ignore[literal-required]
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
        if self.parser.should_upgrade():  # Connection: upgrade + Upgrade, or CONNECT
            method = self.parser.get_method()
            if method == b"CONNECT":
                self._refuse(405, "CONNECT is not supported: the gateway is not a forward proxy.",
                             "invalid_request_error", b"allow: GET, HEAD, POST\r\n")
                return
            self._upgrade = (method, self.url, self.parser.get_http_version(), self.headers)
            return  # llhttp ends the message here, without its body: data_received parses it again
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
        if not self._refused and self._upgrade is None:
            super().on_message_complete()

    # -- writes the client does not read -------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.edge.client_send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.abort()  # nothing can be written to a client that does not read: no answer

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
        for timer in (self._head_timer, self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._send_timer = None

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
