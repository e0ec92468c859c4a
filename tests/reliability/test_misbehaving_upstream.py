"""The harness itself: a plain client against `misbehaving_upstream` gets the bytes and the
faults each scenario promises, so a failing relay test points at the gateway, not at it."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from tests.integration.gateway_support import poll
from tests.reliability.relay_support import (
    CHAT,
    STREAM,
    exchange,
    host_port,
    raw_request,
    upstream_process,
)
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import (
    chunk,
    cut,
    error_body,
    head,
    json_body,
    sse_events,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


def read_until_closed_or(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


def test_probes_answer() -> None:
    with misbehaving_upstream() as up, httpx.Client(base_url=up.url, timeout=2) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "llama-3.1-8b"
        assert "vllm:cache_config_info" in client.get("/metrics").text
        assert client.get("/nowhere").status_code == 404


@pytest.mark.parametrize("newline", ["lf", "crlf", "cr"])
def test_sse_bytes_and_writes_on_the_wire(newline: str) -> None:
    """Each write is one chunk on the wire; a cut inside a CRLF pair lands where asked."""
    data = b"".join(sse_events(newline))
    offsets = [data.index(b"\r\n") + 1] if newline == "crlf" else [7, 300]
    with misbehaving_upstream() as up:
        sock = raw_request(up.url, STREAM, {"x-newline": newline, "x-cuts": ",".join(map(str, offsets))})
        with sock:
            wire = read_until_closed_or(sock, b"0\r\n\r\n")
        assert wire == head(200, "text/event-stream", None) + b"".join(map(chunk, cut(data, offsets))) + b"0\r\n\r\n"
        assert up.posts[0].sent == data and up.posts[0].body == json.dumps(STREAM).encode()
        got = exchange(up.url, STREAM, {"x-newline": newline, "x-gap-s": "0.01"})
        assert got.body == data and got.error is None


def test_json_and_status() -> None:
    with misbehaving_upstream() as up:
        assert exchange(up.url, CHAT).body == json_body()
        got = exchange(up.url, CHAT, {"x-scenario": "status", "x-status": "503"})
        assert got.status == 503 and got.body == error_body(503)


@pytest.mark.parametrize(("end", "error"), [("fin", "RemoteProtocolError"), ("reset", "ReadError")])
def test_done_then_a_close_without_the_chunked_terminator(end: str, error: str) -> None:
    with misbehaving_upstream() as up:
        got = exchange(up.url, STREAM, {"x-end": end, "x-gap-s": "0.02"})
        assert got.body == b"".join(sse_events()) and got.error.startswith(error), got.error


SILENCES = {"silent": {"x-scenario": "silent"}, "headers-only": {"x-send-pieces": "0", "x-end": "stall"},
            "half-a-body": {"x-cuts": "30", "x-send-pieces": "1", "x-end": "stall"}}


@pytest.mark.parametrize(("body", "script"), [
    *((CHAT, s) for s in SILENCES.values()), *((STREAM, s) for s in SILENCES.values()),
    (STREAM, {"x-send-pieces": "1", "x-end": "stall"}),
], ids=[*(f"body-{k}" for k in SILENCES), *(f"stream-{k}" for k in SILENCES), "stream-one-event"])
def test_silences_last_until_the_client_leaves_and_the_close_is_recorded(body: dict, script: dict) -> None:
    with misbehaving_upstream(script) as up, httpx.Client(base_url=up.url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout), client.stream("POST", "/v1/chat/completions", json=body) as resp:
            for _ in resp.iter_raw():
                pass
        left = time.monotonic()  # httpx has dropped the connection by now
        closed = poll(lambda: up.posts[0].closed_s, "the close to be recorded", timeout_s=2)
        # The silence lasted until the client's 0.3 s read timeout (not closed early by the upstream); the server
        # stamps its receipt a little after the client's timer starts, so the floor allows for that (0.27 s seen).
        assert up.posts[0].received_s + 0.2 <= closed <= left + 0.1


def test_slow_first_byte() -> None:
    with misbehaving_upstream() as up:
        got = exchange(up.url, CHAT, {"x-delay-s": "0.3"})
        assert got.body == json_body() and got.elapsed_s >= 0.3


@pytest.mark.parametrize("scenario", ["reset", "close"])
def test_a_close_before_anything(scenario: str) -> None:
    with misbehaving_upstream({"x-scenario": scenario}) as up, pytest.raises(httpx.TransportError):
        exchange(up.url, CHAT)
    assert up.posts[0].closed_s is None  # closed by the upstream, not by its peer


def test_chunked_request_bodies_expect_without_100_and_keep_alive() -> None:
    payload = json.dumps(CHAT).encode()
    with misbehaving_upstream() as up:
        sock = socket.create_connection(host_port(up.url), timeout=2)
        with sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Transfer-Encoding: chunked\r\nX-Twice: 1\r\nX-Twice: 2\r\n\r\n")
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(100)  # no "100 Continue", ever
            sock.settimeout(2)
            sock.sendall(chunk(payload[:10]) + chunk(payload[10:]) + b"0\r\n\r\n")
            assert read_until_closed_or(sock, json_body()) == head(200, "application/json", len(json_body())) + json_body()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # same connection: keep-alive
            assert read_until_closed_or(sock, b'{"status": "ok"}').startswith(b"HTTP/1.1 200 OK")
        assert up.posts[0].body == payload
        assert up.posts[0].headers["expect"] == "100-continue" and up.posts[0].headers["x-twice"] == "1, 2"


def test_freeze_stops_every_answer_until_thaw() -> None:
    with misbehaving_upstream() as up:
        up.freeze()
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(up.url + "/health", timeout=0.3)
        up.thaw()
        assert httpx.get(up.url + "/health", timeout=2).status_code == 200


def test_force_overrides_the_request_headers() -> None:
    with misbehaving_upstream({"x-scenario": "status", "x-status": "502"}) as up:
        assert exchange(up.url, CHAT, {"x-scenario": "json"}).status == 502
        up.force = {}
        assert exchange(up.url, CHAT, {"x-scenario": "json"}).status == 200


def test_as_a_process_sigstop_freezes_it_and_sigcont_thaws_it() -> None:
    with upstream_process() as (proc, url):
        os.kill(proc.pid, signal.SIGSTOP)  # a process this test started
        try:
            with pytest.raises(httpx.ReadTimeout):
                httpx.get(url + "/health", timeout=0.3)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert httpx.get(url + "/health", timeout=2).status_code == 200
