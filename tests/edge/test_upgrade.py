"""``Upgrade`` and the states a connection may not sit in past a bound (issue 28 items 2, 3, 7a).

Raw sockets on 127.0.0.1 against a real gateway served with the edge protocol, in front of a
real fake upstream. On the code before issue 28's edge work a ``POST`` with ``Upgrade:
websocket`` was handed to uvicorn's WebSocket protocol and never answered nor closed, an
``h2c`` upgrade lost its body (400 "zero-length document"), ``CONNECT`` was left open, a
response the client never read held its connection for ever, and the trailing-slash 307
pointed at the client's ``Host``: each test below fails there.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.edge.test_connections import BODY, RECV_TIMEOUT_S, closed_by_server, connect, gateway, read_response
from tests.integration.gateway_support import backend_doc, poll, run_fakes, run_gateway
from tests.support.fake_upstream import Script

pytestmark = pytest.mark.integration

KEEP_ALIVE_S = 1.0
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
WEBSOCKET = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" \
            b"Sec-WebSocket-Version: 13\r\n"


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The Content-Length-framed HTTP/1.1 responses in ``data``, in order."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, data[:length]))
        data = data[length:]
    return out


def request(extra: bytes, body: bytes = BODY, *, chunked: bool = False) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + extra
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("upgrade", [WEBSOCKET, H2C, b"Connection: upgrade\r\nUpgrade: foo/2\r\n"],
                         ids=["websocket", "h2c", "other"])
def test_an_upgrade_request_is_answered_as_http11_with_its_body_and_the_connection_stays_bounded(upgrade: bytes) -> None:
    script = Script()
    with run_fakes([script]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"keep_alive_timeout_s": KEEP_ALIVE_S}) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "the gateway to be ready")
        parts = urlsplit(gw.url)
        for chunked in (False, True):
            sock = connect((parts.hostname, parts.port))
            sock.sendall(request(upgrade, chunked=chunked) * 2)  # two pipelined: the second parses after the first
            started = time.monotonic()
            answers = responses(read_until_closed(sock))  # closed: an answered upgrade is an idle keep-alive
            assert time.monotonic() - started < KEEP_ALIVE_S + 3.0
            assert len(answers) == 2
            for status, headers, body in answers:
                assert status == 200 and headers["x-kappa-backend"] == "b0", body
                assert json.loads(body)["choices"]
            sock.close()
        assert len(script.received) == 4
        for got in script.received:
            assert got["body"] == BODY, "the body must be read as HTTP/1.1 framing says"
            assert "upgrade" not in got["headers"] and "http2-settings" not in got["headers"]


def test_connect_is_refused_with_405_and_closed() -> None:
    with gateway() as addr:
        sock = connect(addr)
        sock.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 405 and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert closed_by_server(sock)
        sock.close()


def test_a_response_the_client_never_reads_is_aborted_after_the_send_timeout() -> None:
    script = Script(chunks=200_000)  # ~40 MB of SSE: far past every socket buffer
    with run_fakes([script]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"client_send_timeout_s": 0.5}) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "the gateway to be ready")
        parts = urlsplit(gw.url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((parts.hostname, parts.port))
        body = json.dumps({"model": "llama-3.1-8b", "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        sock.sendall(request(b"", body))  # and never read the answer
        poll(lambda: gw.metric("gateway_requests_total", status="client_disconnect") == 1,
             "the stalled write to end the request", timeout_s=RECV_TIMEOUT_S)
        sock.close()


def test_the_trailing_slash_redirect_is_relative_not_built_from_host() -> None:
    with gateway() as addr:
        sock = connect(addr)
        sock.sendall(b"GET /health/?probe=1 HTTP/1.1\r\nHost: attacker.example\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 307 and headers["location"] == "/health?probe=1"
        sock.close()
