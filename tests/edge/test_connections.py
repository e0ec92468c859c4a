"""Connection hygiene at the gateway's listener: read timeouts, keep-alive, the connection cap.

Raw sockets on 127.0.0.1 against a real gateway served as `gateway.serving.server` serves it (the
edge protocol), in front of a real fake upstream. On uvicorn's own protocol (65d19c0) a
stalled head or body held its socket for ever, an idle keep-alive connection closed after 5 s,
and nothing capped connections: each test below fails there.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

import pytest

from fleet_config.edge import DEFAULT_KEEP_ALIVE_TIMEOUT_S
from fleet_config.settings import GatewaySection
from tests.integration.gateway_support import backend_doc, poll, run_fakes, run_gateway
from tests.support.fake_upstream import Script

pytestmark = pytest.mark.integration

BODY = json.dumps({"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
RECV_TIMEOUT_S = 10.0  # far above every configured bound below: a missing close fails, it does not hang


@contextmanager
def gateway(**edge: object) -> Iterator[tuple[str, int]]:
    with run_fakes([Script()]) as (url,), run_gateway([backend_doc("b0", url)], gateway=dict(edge)) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "the gateway to be ready")
        parts = urlsplit(gw.url)
        yield parts.hostname, parts.port


def connect(addr: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(addr)
    sock.settimeout(RECV_TIMEOUT_S)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def closed_by_server(sock: socket.socket) -> bool:
    """Reads until EOF (True) or a reset (True); a recv timeout fails the test instead."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_the_default_keep_alive_outlasts_common_client_pools() -> None:
    # aiohttp keeps idle connections 15 s, nginx's keepalive_timeout is 75 s; uvicorn's 5 s default
    # closed connections clients were about to reuse (ServerDisconnectedError in replays).
    assert GatewaySection().keep_alive_timeout_s == DEFAULT_KEEP_ALIVE_TIMEOUT_S == 75.0


def test_an_idle_keep_alive_connection_is_reused_past_uvicorns_5s_and_closed_after_the_configured_bound() -> None:
    with gateway(keep_alive_timeout_s=7.0) as addr:
        sock = connect(addr)
        sock.sendall(REQUEST)
        assert read_response(sock)[0] == 200
        time.sleep(5.5)  # idle past uvicorn's default keep-alive (the behaviour under test, not readiness)
        sock.sendall(REQUEST)
        assert read_response(sock)[0] == 200, "the connection must still serve after 5.5 s idle"
        started = time.monotonic()
        assert closed_by_server(sock)
        assert 6.0 < time.monotonic() - started < RECV_TIMEOUT_S
        sock.close()


def test_a_stalled_request_head_gets_408_and_the_connection_closes() -> None:
    with gateway(client_header_timeout_s=0.5) as addr:
        for partial in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"):
            sock = connect(addr)
            sock.sendall(partial)
            started = time.monotonic()
            status, headers, body = read_response(sock)
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == 408
            assert closed_by_server(sock)
            assert time.monotonic() - started < 5.0
            sock.close()


def test_a_stalled_request_body_gets_408_and_is_counted_as_a_client_disconnect() -> None:
    with run_fakes([Script()]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"client_body_timeout_s": 0.5}) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "the gateway to be ready")
        parts = urlsplit(gw.url)
        sock = connect((parts.hostname, parts.port))
        sock.sendall(REQUEST[: len(REQUEST) - len(BODY) // 2])  # head and half the body, then nothing
        status, headers, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["type"] == "invalid_request_error"
        assert closed_by_server(sock)
        sock.close()
        poll(lambda: gw.metric("gateway_requests_total", status="client_disconnect") == 1,
             "the abandoned request to be counted")


def test_a_malformed_request_head_gets_an_openai_shaped_400() -> None:
    with gateway() as addr:
        sock = connect(addr)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 400 and json.loads(body)["error"]["code"] == 400
        sock.close()


def test_above_the_connection_cap_idle_connections_go_first_then_new_ones_get_503() -> None:
    with gateway(max_client_connections=3, client_header_timeout_s=30.0) as addr, ExitStack() as stack:
        idle = []
        for _ in range(3):
            sock = stack.enter_context(connect(addr))
            sock.sendall(REQUEST)
            assert read_response(sock)[0] == 200
            idle.append(sock)
        newcomer = stack.enter_context(connect(addr))
        newcomer.sendall(REQUEST)
        assert read_response(newcomer)[0] == 200, "an idle keep-alive connection should have made room"
        assert closed_by_server(idle[0]), "the oldest idle connection is the one closed"
        # Now fill the cap with connections mid-head (not idle): the next one is refused, 503.
        busy = [stack.enter_context(connect(addr)) for _ in range(3)]
        for sock in busy:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        refused = stack.enter_context(connect(addr))
        refused.sendall(REQUEST)
        status, headers, body = read_response(refused)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["type"] == "service_unavailable_error"
        assert closed_by_server(refused)


def test_a_request_head_over_the_limit_gets_431_before_anything_is_forwarded() -> None:
    script = Script()
    with run_fakes([script]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"max_header_bytes": 8192}) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "the gateway to be ready")
        parts = urlsplit(gw.url)
        for head in (b"X-Big: " + b"a" * 20_000 + b"\r\n",  # one huge header
                     b"".join(b"X-H%d: v\r\n" % i for i in range(2_000))):  # many small ones
            sock = connect((parts.hostname, parts.port))
            sock.sendall(REQUEST.replace(b"Host: gw\r\n", b"Host: gw\r\n" + head))
            status, headers, body = read_response(sock)
            assert status == 431 and json.loads(body)["error"]["code"] == 431
            assert closed_by_server(sock)
            sock.close()
        assert script.received == []  # nothing reached the backend
        assert gw.http.post("/v1/chat/completions", content=BODY).status_code == 200  # a normal head still passes
