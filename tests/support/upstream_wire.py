"""HTTP/1.1 on the wire for `misbehaving_upstream`: a connection that reads requests (and
sees its peer close at once), and the bytes sent back — SSE events in three line endings, a
chat JSON body, response heads, chunks, the vLLM metrics page. Tests build their expected
bytes from the same functions. Imports none of the project's packages (STYLE.md B2).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import pairwise

MODEL = "llama-3.1-8b"
NEWLINES = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
# cached_tokens is not 0, so a test can tell from gateway_cached_tokens_reported_total that usage was recorded.
USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 7}}
REASONS = {200: "OK", 404: "Not Found", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


def _chunk(choices: list[dict], **extra: object) -> dict:
    return {"id": "chatcmpl-mis", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": choices, **extra}


def sse_events(newline: str = "lf", n: int = 3, usage: bool = True) -> list[bytes]:
    """A chat stream's events: ``n`` content deltas ("t0", "t1", …), the usage chunk
    (``{"choices": [], "usage": …}``) unless ``usage`` is False, then ``data: [DONE]``;
    each line ended by ``newline`` (lf | crlf | cr) and each event by a blank line."""
    nl = NEWLINES[newline]
    chunks = [_chunk([{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": "length" if i == n - 1 else None}])
              for i in range(n)]
    if usage:
        chunks.append(_chunk([], usage=USAGE))
    return [b"data: " + json.dumps(c).encode() + nl + nl for c in chunks] + [b"data: [DONE]" + nl + nl]


def event_offsets(events: list[bytes]) -> list[int]:
    """Byte offsets of the boundaries between ``events`` in their concatenation."""
    return [sum(map(len, events[: i + 1])) for i in range(len(events) - 1)]


def json_body() -> bytes:
    """A non-streamed chat completion with `USAGE`."""
    return json.dumps({"id": "chatcmpl-mis", "object": "chat.completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                    "finish_reason": "stop"}], "usage": USAGE}).encode()


def error_body(status: int, error_type: str = "server_error", message: str | None = None) -> bytes:
    return json.dumps({"error": {"message": f"scripted {status}" if message is None else message,
                                 "type": error_type, "param": None, "code": status}}).encode()


def cut(data: bytes, offsets: list[int]) -> list[bytes]:
    """``data`` split at ``offsets`` (ascending byte positions); no empty pieces."""
    bounds = [0, *offsets, len(data)]
    return [data[a:b] for a, b in pairwise(bounds) if b > a]


def head(status: int, content_type: str, length: int | None) -> bytes:
    """A response head: ``Content-Length`` when ``length`` is given, else chunked."""
    size = "transfer-encoding: chunked\r\ncache-control: no-cache" if length is None else f"content-length: {length}"
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\ncontent-type: {content_type}\r\n"
            f"{size}\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="0"}} 0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000",engine="0"} 1\n'
    "# TYPE process_start_time_seconds gauge\n"
    "process_start_time_seconds 1000.0\n"
).encode()
# GET routes: path -> (body, content type)
GETS = {
    "/health": (b'{"status": "ok"}', "application/json"),
    "/metrics": (METRICS, "text/plain; version=0.0.4; charset=utf-8"),
    "/v1/models": (json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
                   "application/json"),
}


@dataclass(eq=False)
class Conn:
    """One accepted connection: bytes read and not yet parsed, and when the peer closed it."""

    closed_s: float | None = None  # time.monotonic() when the peer closed or reset it
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # closed, by either side
    by_us: bool = False
    buf: bytearray = field(default_factory=bytearray)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def pump(self, reader: asyncio.StreamReader) -> None:
        """Read until EOF, whatever the script is doing, so a close is seen when it happens."""
        try:
            while data := await reader.read(65536):
                self.buf += data
                self.changed.set()
        except OSError:
            pass  # a reset is a close
        if not self.by_us:
            self.closed_s = time.monotonic()
        self.closed.set()
        self.changed.set()

    async def take(self, n: int | None = None, until: bytes = b"") -> bytes | None:
        """``n`` bytes, or the bytes up to and including ``until``; None if the peer closed first."""
        while True:
            found = self.buf.find(until) if n is None else -1
            end = (found + len(until) if found >= 0 else -1) if n is None else (n if len(self.buf) >= n else -1)
            if end >= 0:
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            if self.closed.is_set():
                return None
            self.changed.clear()
            await self.changed.wait()

    async def pause(self, seconds: float) -> bool:
        """The scripted wait (cut short if the peer closes); True if the peer has closed."""
        if seconds > 0:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), seconds)
        return self.closed.is_set()

    def close(self, writer: asyncio.StreamWriter, *, reset: bool) -> bool:
        self.by_us = True
        if reset:  # SO_LINGER on with 0 s: close() sends RST instead of FIN
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        return False

    async def read_request(self) -> tuple[str, str, dict[str, str], bytes] | None:
        """Method, path, headers (names lower-cased, repeats joined with ", ") and body (by
        Content-Length or chunked); None if the peer closed first."""
        raw = await self.take(until=b"\r\n\r\n")
        if raw is None:
            return None
        line, *lines = raw.decode("latin-1").split("\r\n")[:-2]
        method, path, _ = line.split(" ", 2)
        headers: dict[str, str] = {}
        for h in lines:
            name, _, value = h.partition(":")
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        body = await self._body(headers)
        return None if body is None else (method, path, headers, body)

    async def _body(self, headers: dict[str, str]) -> bytes | None:
        if "chunked" not in headers.get("transfer-encoding", "").lower():
            return await self.take(int(headers.get("content-length", "0")))
        parts = []
        while (size_line := await self.take(until=b"\r\n")) is not None:
            size = int(size_line.split(b";")[0], 16)
            if size == 0:  # then trailers, up to a blank line
                while (trailer := await self.take(until=b"\r\n")) != b"\r\n":
                    if trailer is None:
                        return None
                return b"".join(parts)
            data = await self.take(size + 2)
            if data is None:
                return None
            parts.append(data[:-2])
        return None
