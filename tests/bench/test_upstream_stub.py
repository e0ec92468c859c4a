"""`bench/upstream_stub.py` on the wire: the real stub process on 127.0.0.1, raw sockets for
what HTTP clients hide (pipelining, pieces, chunked bodies, ``Expect``, closing), the official
``openai`` client for the answers' shape. Correctness only: no timed assertions.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httptools
import httpx
import openai
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
TIMEOUT_S = 10.0
BYTES_PER_TOKEN = 4  # what the stub divides a body's length by (prefix_index.hashing.BYTES_PER_TOKEN_ESTIMATE)
STREAM_BODY = b'{"stream":true,"model":"m","messages":[{"role":"user","content":"hello"}]}'
JSON_BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}'


@pytest.fixture(scope="module")
def stub_ports() -> Iterator[list[int]]:
    proc = subprocess.Popen([sys.executable, str(BENCH_DIR / "upstream_stub.py"), "--listeners", "2"],
                            stdout=subprocess.PIPE)
    try:
        line = proc.stdout.readline() if proc.stdout else b""
        assert line, "the stub exited before printing its ports"
        yield json.loads(line)["ports"]
    finally:
        proc.terminate()
        proc.wait(TIMEOUT_S)
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture
def port(stub_ports: list[int]) -> int:
    return stub_ports[0]


class Response:
    """One parsed response: status, headers (names lower-cased), body (chunked framing removed)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    def json(self) -> dict:
        return json.loads(self.body)


class Responses:
    """Responses parsed by httptools as their bytes are fed; ``complete`` counts the whole ones."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.all: list[Response] = []
        self.complete = 0

    def feed(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.all.append(Response())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.all[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.all[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.all[-1].body += body

    def on_message_complete(self) -> None:
        self.complete += 1


def parse_responses(data: bytes) -> list[Response]:
    """Every complete response in ``data``, in order."""
    responses = Responses()
    responses.feed(data)
    return responses.all[: responses.complete]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_responses(sock: socket.socket, n: int) -> list[Response]:
    """Read until ``n`` whole responses have arrived (the connection stays open)."""
    responses = Responses()
    while responses.complete < n:
        data = sock.recv(65536)
        assert data, "the stub closed the connection"
        responses.feed(data)
    return responses.all


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: stub\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n" % len(body) + extra + b"\r\n" + body)


def sse_data(body: bytes) -> list[bytes]:
    return [event.removeprefix(b"data: ") for event in body.split(b"\n\n") if event]


def test_prints_its_ports_once_listening_on_each(stub_ports: list[int]) -> None:
    assert len(set(stub_ports)) == 2
    for p in stub_ports:  # no polling: the ports are printed after listen()
        with connect(p) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: stub\r\n\r\n")
            (answer,) = read_responses(sock, 1)
            assert (answer.status, answer.body) == (200, b"{}")


def test_openai_client_gets_a_completion_with_usage_from_the_body_length(port: int) -> None:
    sent: list[int] = []
    http_client = httpx.Client(event_hooks={"request": [lambda r: sent.append(len(r.content))]})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="stub", max_retries=0,
                           timeout=TIMEOUT_S, http_client=http_client)
    messages = [{"role": "user", "content": "x" * 1000}]
    answer = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "t0 t1 t2"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sent[0] // BYTES_PER_TOKEN
    assert (answer.usage.completion_tokens, answer.usage.total_tokens) == (3, answer.usage.prompt_tokens + 3)

    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t0t1t2"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == sent[1] // BYTES_PER_TOKEN
    http_client.close()


def test_stream_is_one_chunk_per_event_then_usage_and_done(port: int) -> None:
    """The framing the uvicorn stub sent and the proxies under test read: each content event
    in its own chunk, then one chunk with the usage event and [DONE]."""
    with connect(port) as sock:
        sock.sendall(post(b"/v1/chat/completions", STREAM_BODY, b"Connection: close\r\n"))
        raw = read_until_closed(sock)
    head, _, framed = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and b"content-type: text/event-stream" in head
    chunks = []
    while framed:
        size, _, rest = framed.partition(b"\r\n")
        chunks.append(rest[: int(size, 16)])
        framed = rest[int(size, 16) + 2:]
    assert chunks[-1] == b""  # the last chunk, nothing after it
    events = [sse_data(chunk) for chunk in chunks[:-1]]
    assert [len(e) for e in events] == [1, 1, 1, 2]
    deltas = [json.loads(e[0])["choices"][0] for e in events[:3]]
    assert [(d["delta"]["content"], d["finish_reason"]) for d in deltas] == [("t0", None), ("t1", None),
                                                                              ("t2", "length")]
    usage = json.loads(events[3][0])["usage"]
    assert usage["prompt_tokens"] == len(STREAM_BODY) // BYTES_PER_TOKEN
    assert events[3][1] == b"[DONE]"


def test_pipelined_requests_are_answered_in_order_and_close_stops_the_connection(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(post(b"/v1/chat/completions", STREAM_BODY) + post(b"/v1/completions", JSON_BODY)
                     + b"GET /metrics HTTP/1.1\r\nHost: stub\r\n\r\n"
                     + b"GET /nowhere HTTP/1.1\r\nHost: stub\r\nConnection: close\r\n\r\n"
                     + b"GET /health HTTP/1.1\r\nHost: stub\r\n\r\n")  # after the close: not answered
        answers = parse_responses(read_until_closed(sock))
    assert [a.status for a in answers] == [200, 200, 200, 404]
    assert answers[0].headers["content-type"] == "text/event-stream"
    assert sse_data(answers[0].body)[-1] == b"[DONE]"
    assert answers[1].json()["usage"]["prompt_tokens"] == len(JSON_BODY) // BYTES_PER_TOKEN
    assert answers[1].headers["content-length"] == str(len(answers[1].body))
    assert b"vllm:num_requests_waiting" in answers[2].body
    assert answers[3].json() == {"error": "not found"}
    assert answers[3].headers["connection"] == "close"


def test_keep_alive_serves_requests_one_after_another(port: int) -> None:
    with connect(port) as sock:
        for _ in range(3):
            sock.sendall(post(b"/v1/chat/completions", JSON_BODY))
            (answer,) = read_responses(sock, 1)
            assert answer.json()["choices"][0]["message"]["content"] == "t0 t1 t2"
            assert "connection" not in answer.headers


def test_a_body_in_one_byte_pieces_with_stream_moved_last(port: int) -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"y" * 300 + b'"}],"stream":true}'
    with connect(port) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in post(b"/v1/chat/completions", body):
            sock.sendall(bytes([byte]))
        (answer,) = read_responses(sock, 1)
    events = sse_data(answer.body)
    assert answer.headers["content-type"] == "text/event-stream"
    assert json.loads(events[-2])["usage"]["prompt_tokens"] == len(body) // BYTES_PER_TOKEN


def test_a_chunked_request_body_is_counted_without_its_framing(port: int) -> None:
    body = b'{"model":"m","stream":false,"messages":[{"role":"user","content":"' + b"z" * 200 + b'"}]}'
    pieces = [body[i:i + 37] for i in range(0, len(body), 37)]
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: stub\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
        (answer,) = read_responses(sock, 1)
    assert answer.json()["usage"]["prompt_tokens"] == len(body) // BYTES_PER_TOKEN


def test_expect_100_continue_is_answered_before_the_body_is_sent(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: stub\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(JSON_BODY))
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):  # a stub that waits for the body times out here
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(JSON_BODY)
        (answer,) = read_responses(sock, 1)
    assert answer.json()["usage"]["prompt_tokens"] == len(JSON_BODY) // BYTES_PER_TOKEN


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive\r\n"], ids=["plain", "keep-alive"])
def test_http_1_0_stream_is_sent_unchunked_and_closed(port: int, connection: bytes) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\n%sContent-Length: %d\r\n\r\n%s" % (
            connection, len(STREAM_BODY), STREAM_BODY))
        raw = read_until_closed(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head and b"content-length: %d\r\n" % len(body) in head
    assert sse_data(body)[-1] == b"[DONE]" and len(sse_data(body)) == 5


def test_head_gets_headers_without_a_body(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: stub\r\n\r\nGET /health HTTP/1.1\r\nHost: stub\r\n"
                     b"Connection: close\r\n\r\n")
        raw = read_until_closed(sock)
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 2" in first
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.endswith(b"\r\n\r\n{}")


def test_an_unparsable_request_gets_400_and_a_close(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"NOT HTTP\x00\r\n\r\n")
        (answer,) = parse_responses(read_until_closed(sock))
    assert (answer.status, answer.headers["connection"]) == (400, "close")


def cached_tokens(port: int, body: bytes, stream: bool = False) -> int:
    with connect(port) as sock:
        sock.sendall(post(b"/v1/chat/completions", body))
        (answer,) = read_responses(sock, 1)
    usage = json.loads(sse_data(answer.body)[-2])["usage"] if stream else answer.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_are_the_longest_prefix_this_port_served_in_whole_blocks(stub_ports: list[int]) -> None:
    """As vLLM's prefix cache reports them, per port (each port a backend), so that the gateway's
    index-truth check is not contradicted by every answer (it was: 0 cached tokens, always)."""
    block_tokens = 256 // BYTES_PER_TOKEN  # the stub's block: 256 bytes
    shared = b'{"model":"m","messages":[{"role":"system","content":"' + b"s" * 4000 + b'"},'
    first = shared + b'{"role":"user","content":"' + b"a" * 3000 + b'"}]}'
    second = shared + b'{"role":"user","content":"' + b"b" * 3000 + b'"}]}'
    one, other = stub_ports
    assert cached_tokens(one, first) == 0  # never served here
    assert cached_tokens(one, first) == len(first) // 256 * block_tokens  # every whole block, now held
    assert cached_tokens(one, second) == len(shared) // 256 * block_tokens  # the shared head's whole blocks
    streamed = b'{"stream":true,' + second[1:]  # another first block: nothing shared
    assert cached_tokens(one, streamed, stream=True) == 0
    assert cached_tokens(one, streamed, stream=True) == len(streamed) // 256 * block_tokens
    assert cached_tokens(other, first) == 0  # the other port (backend) has prefilled nothing of it
