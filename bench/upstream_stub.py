"""A minimal OpenAI-shaped upstream that answers at once, on several loopback ports in one process.

Used by ``bench/overhead.py`` as the backend of every configuration (direct, bare proxy,
gateway, peer routers), so that what differs between them is only the proxy in the middle.

What it answers (HTTP/1.1, keep-alive; the body read whole before any answer):

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a body with ``"stream": true``
  gets a short SSE stream (three content events, a usage event, ``[DONE]``) in chunked
  transfer, written as five writes (the head, one per content event, then the usage event,
  ``[DONE]`` and the last chunk), so a proxy reads one segment per event;
  any other body one JSON completion with ``Content-Length``, in one write.
  ``usage.prompt_tokens`` is the body's length / ``BYTES_PER_TOKEN_ESTIMATE`` (4; the
  gateway calibrates bytes per token from it), and ``prompt_tokens_details.cached_tokens`` what
  a vLLM engine with prefix caching would report: each port keeps the prefixes it has served
  (`PrefixCache`), and the longest one of this body, in 64-token blocks of 256 bytes, is cached.
  The gateway's index-truth check takes answers that keep reporting under half of what the
  index credited as an emptied cache and forgets the backend's entries; answering like a
  prefix cache keeps the index from churning under the bench's load (BENCHMARKS.md,
  "`serve --workers 2`"). The bench's own bodies put ``stream`` first,
  so their first bytes decide; a body that a router re-serialised (sglang-router and
  vllm-router move ``stream`` after the messages) is searched whole.
- ``GET /health``: 200 ``{}``. ``GET /metrics``: a minimal vLLM-style page (an idle engine).
- Anything else: 404 ``{"error":"not found"}``; a request httptools cannot parse: 400, closed.

Requests may be pipelined, sent in many pieces, with a ``Transfer-Encoding: chunked`` body
or ``Expect: 100-continue`` (answered ``100 Continue`` once the head is in). A request with
``Connection: close`` (or HTTP/1.0 without keep-alive) is answered with ``connection: close``
and the connection closed; an HTTP/1.0 stream is sent unchunked, then the connection closed.
Idle connections are never timed out (the clients close theirs). Every answer has a ``date``
header, refreshed each second; there is no ``server`` header.

Why raw (`asyncio.Protocol` on uvloop, `httptools.HttpRequestParser`, answers pre-encoded
or cached per prompt length, the prefix cache one C call that hashes the body's blocks)
rather than an ASGI app on uvicorn: the stub shares the machine's two cores with the server
under test, so its CPU is taken from the measurement (measured in BENCHMARKS.md, "The hot
path (issue 14)"). Sending a whole stream in one write would cost less CPU
still, but would change the segments the proxies under test read. It imports nothing of the
project but the bytes-per-token estimate and the chain hash.

    python bench/upstream_stub.py --listeners 8     # prints {"ports": [...]} once listening
    python bench/upstream_stub.py --port 8123       # listens on the given port(s) instead
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
from email.utils import formatdate

import httptools
import uvloop

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from prefix_index.hashing import (  # ~bytes per token of the bench's prompts
    BYTES_PER_TOKEN_ESTIMATE,
    block_hashes,
)

# A JSON string cannot hold these bytes (its quotes are escaped), so a match is the key itself;
# compact (Rust serde_json, the bench) and Python json.dumps spacing.
STREAM_TRUE = (b'"stream":true', b'"stream": true')
STREAM_FALSE = (b'"stream":false', b'"stream": false')
STREAM_MARK_WINDOW_BYTES = 64  # the load generator writes "stream" as the body's first key
CONTENT_EVENTS = 3
COMPLETION_PATHS = (b"/v1/chat/completions", b"/v1/completions")
LISTEN_BACKLOG = 2048  # uvicorn's default, which this stub replaced
DATE_REFRESH_S = 1.0  # the Date header's resolution (RFC 9110 §6.6.1: seconds)
CACHED_PROMPT_LENGTHS = 4096  # answers kept per distinct (prompt, cached) tokens; the bench sends a few dozen
PREFIX_BLOCK_BYTES = 256  # a 64-token block (the gateway's index block) at BYTES_PER_TOKEN_ESTIMATE
PREFIX_CACHE_BLOCKS = 1 << 20  # blocks a port keeps before it empties its cache (~100 MB at most)

METRICS_PAGE = (
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{engine="0"} 0\n'
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{engine="0"} 0\n'
    b"# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{engine="0"} 0\n'
    b"# TYPE process_start_time_seconds gauge\n"
    b"process_start_time_seconds 1000\n"
)
OK, NOT_FOUND, BAD_REQUEST = b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 404 Not Found\r\n", b"HTTP/1.1 400 Bad Request\r\n"
JSON = b"content-type: application/json\r\n"
SSE = b"content-type: text/event-stream\r\ncache-control: no-cache\r\n"
TEXT = b"content-type: text/plain; version=0.0.4\r\n"  # Prometheus text exposition
PLAIN = b"content-type: text/plain; charset=utf-8\r\n"
CHUNKED = b"transfer-encoding: chunked\r\n"
CLOSE = b"connection: close\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def wants_stream(body: bytes) -> bool:
    """Whether a completions body asks for an SSE answer (``"stream": true`` at its top level).

    The first ``STREAM_MARK_WINDOW_BYTES`` decide when they hold the key (the bench's bodies,
    at no cost per body size); otherwise the whole body is searched, for bodies a router
    re-serialised. A nested ``"stream"`` key would also match: the bench sends none.
    """
    head = body[:STREAM_MARK_WINDOW_BYTES]
    if any(mark in head for mark in STREAM_TRUE):
        return True
    if any(mark in head for mark in STREAM_FALSE):
        return False
    return any(mark in body for mark in STREAM_TRUE)


class PrefixCache:
    """What one port (one backend) has prefilled, as vLLM's prefix cache holds it: every block of
    every body it answered, as chained hashes (`prefix_index.hashing.block_hashes` over the raw
    body, ``PREFIX_BLOCK_BYTES`` a block), so a held block's ancestors are held too. A body's
    cached tokens are its longest held prefix. Nothing is evicted until ``PREFIX_CACHE_BLOCKS``,
    then everything (the bench's prompts fit many times over)."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def cached_tokens(self, body: bytes) -> int:
        """Tokens of ``body``'s longest prefix served before on this port (whole blocks); then the
        body's blocks are held."""
        chain = block_hashes(body, block_size_bytes=PREFIX_BLOCK_BYTES, seed=0)
        if not chain or chain[-1] in self.held:
            matched = len(chain)
        else:
            lo, hi = 0, len(chain) - 1  # the largest m with block m held (held prefixes are closed)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if chain[mid - 1] in self.held:
                    lo = mid
                else:
                    hi = mid - 1
            matched = lo
            if len(self.held) + len(chain) > PREFIX_CACHE_BLOCKS:
                self.held.clear()
            self.held.update(chain)
        return int(matched * PREFIX_BLOCK_BYTES // BYTES_PER_TOKEN_ESTIMATE)


def prompt_tokens(body_bytes: int) -> int:
    """``usage.prompt_tokens`` for a body of ``body_bytes`` bytes: its length / 4, at least 1."""
    return max(int(body_bytes // BYTES_PER_TOKEN_ESTIMATE), 1)


def _usage(prompt: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": CONTENT_EVENTS, "total_tokens": prompt + CONTENT_EVENTS,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _event(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    payload = {"id": "cmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
               "choices": choices}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CONTENT = [_event(f"t{i}", "length" if i == CONTENT_EVENTS - 1 else None) for i in range(CONTENT_EVENTS)]
CONTENT_CHUNKS = [_chunk(event) for event in CONTENT]


@functools.lru_cache(maxsize=CACHED_PROMPT_LENGTHS)
def completion_body(prompt: int, cached: int = 0) -> bytes:
    """The non-streamed answer (``json.dumps`` spacing) for ``prompt`` prompt tokens, ``cached`` of them cached."""
    return json.dumps({"id": "cmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "t0 t1 t2"},
                                    "finish_reason": "length"}], "usage": _usage(prompt, cached)}).encode()


@functools.lru_cache(maxsize=CACHED_PROMPT_LENGTHS)
def stream_tail(prompt: int, cached: int = 0) -> bytes:
    """The stream's end for ``prompt`` prompt tokens (``cached`` of them cached): the usage event
    and ``[DONE]``, unframed."""
    return _event(None, usage=_usage(prompt, cached)) + b"data: [DONE]\n\n"


@functools.lru_cache(maxsize=CACHED_PROMPT_LENGTHS)
def _stream_tail_chunks(prompt: int, cached: int) -> bytes:
    return _chunk(stream_tail(prompt, cached)) + LAST_CHUNK


class DateHeader:
    """The ``date`` header line, rebuilt every ``DATE_REFRESH_S`` by a loop timer (as uvicorn
    does), so an answer costs no clock read."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.line = b""
        self._refresh()

    def _refresh(self) -> None:
        self.line = b"date: " + formatdate(usegmt=True).encode() + b"\r\n"
        self._loop.call_later(DATE_REFRESH_S, self._refresh)


class StubConnection(asyncio.Protocol):
    """One client connection: httptools parses the requests, each is answered as its last byte arrives."""

    def __init__(self, date: DateHeader, cache: PrefixCache) -> None:
        self.date, self.cache = date, cache
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.expect_continue = False
        self.closing = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # no upgrade (h2c, websocket): answered in HTTP/1.1, then closed
            self._close()
        except httptools.HttpParserError:
            if not self.closing:
                self._answer(BAD_REQUEST, PLAIN, b"Invalid HTTP request.\n", False, False)
                self._close()

    def pause_writing(self) -> None:  # a client that does not read its answers stops being read
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        assert self.transport is not None
        self.transport.resume_reading()

    # httptools callbacks, in a request's order

    def on_message_begin(self) -> None:
        self.url, self.body, self.expect_continue = b"", [], False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        if self.expect_continue and not self.closing:
            self._write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.closing:  # pipelined after a request that closed the connection
            return
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = httptools.parse_url(self.url).path
        if method == b"POST" and path in COMPLETION_PATHS:
            body = b"".join(self.body)
            prompt, cached = prompt_tokens(len(body)), self.cache.cached_tokens(body)
            if not wants_stream(body):
                self._answer(OK, JSON, completion_body(prompt, cached), keep_alive, False)
            elif self.parser.get_http_version() == "1.0":  # no chunked for HTTP/1.0: the close ends the body
                keep_alive = False
                self._answer(OK, SSE, b"".join(CONTENT) + stream_tail(prompt, cached), keep_alive, False)
            else:
                self._stream(prompt, cached, keep_alive)
        elif path == b"/health":
            self._answer(OK, JSON, b"{}", keep_alive, method == b"HEAD")
        elif path == b"/metrics":
            self._answer(OK, TEXT, METRICS_PAGE, keep_alive, method == b"HEAD")
        else:
            self._answer(NOT_FOUND, JSON, b'{"error":"not found"}', keep_alive, method == b"HEAD")
        if not keep_alive:
            self._close()

    # answers

    def _answer(self, status: bytes, headers: bytes, body: bytes, keep_alive: bool, head_only: bool) -> None:
        self._write(b"".join((status, self.date.line, headers, b"content-length: %d\r\n" % len(body),
                              b"" if keep_alive else CLOSE, b"\r\n", b"" if head_only else body)))

    def _stream(self, prompt: int, cached: int, keep_alive: bool) -> None:
        self._write(b"".join((OK, self.date.line, SSE, CHUNKED, b"" if keep_alive else CLOSE, b"\r\n")))
        for chunk in CONTENT_CHUNKS:
            self._write(chunk)
        self._write(_stream_tail_chunks(prompt, cached))

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def _close(self) -> None:
        self.closing = True
        assert self.transport is not None
        self.transport.close()  # after the buffered answer is written


async def serve(sockets: list[socket.socket]) -> None:
    """Listen on ``sockets`` (bound, not yet listening), print ``{"ports": [...]}``, serve until killed."""
    loop = asyncio.get_running_loop()
    date = DateHeader(loop)
    for sock in sockets:
        cache = PrefixCache()  # one per port: each port is a backend
        await loop.create_server(functools.partial(StubConnection, date, cache), sock=sock, backlog=LISTEN_BACKLOG)
    print(json.dumps({"ports": [s.getsockname()[1] for s in sockets]}), flush=True)
    await loop.create_future()  # forever: the bench stops the stub with SIGTERM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listeners", type=int, default=8, help="loopback ports to listen on (each port 0)")
    parser.add_argument("--port", type=int, action="append", help="listen on this loopback port (repeatable; "
                        "replaces --listeners)")
    args = parser.parse_args()
    sockets = []
    for port in args.port or [0] * args.listeners:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sockets.append(sock)
    try:
        uvloop.run(serve(sockets))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
