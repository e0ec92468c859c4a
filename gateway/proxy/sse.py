"""Watching a Server-Sent Events stream go by, framed as the SSE spec frames it, bytes unchanged.

SSE (WHATWG HTML §9.2, "Parsing an event stream"): a line ends with CRLF, LF or CR; an event
ends at an empty line; ``data:`` fields carry the payload (one optional space after the colon
is dropped). vLLM ends lines with LF; sse-starlette with CRLF; some servers with CR. Events
may be split anywhere across network reads, several may share one read.

`SseObserver.feed` returns the bytes that complete events and holds back an incomplete
event's bytes until it completes, so that if the backend fails mid-event the gateway's error
event never lands inside a half event; at a clean end of stream `flush` returns what is left.
The concatenation of what it returns is exactly the upstream's bytes. On the side it finds
the first content chunk (TTFT), the gaps between content chunks (ITL), the last ``usage``
object (``stream_options.include_usage``) and ``data: [DONE]``.

The tails the gateway itself appends — after a backend failure, an idle timeout or at
shutdown — are vLLM's own shape for a failed stream: ``data: {"error": …}`` then
``data: [DONE]`` (REFERENCE.md §3).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import error_body

# An empty line: a line terminator followed by another. Atomic groups, so that the LF of a
# CRLF is never taken as a line of its own (CR then LF is one terminator, not two).
_BLANK_LINE = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")
_MAX_PENDING_BYTES = 1 << 20  # an event longer than 1 MiB is relayed without being inspected
DONE_EVENT = b"data: [DONE]\n\n"


class SseObserver:
    """Frames SSE bytes into events and watches them: first content time, gaps, usage, [DONE].

    Args:
        start_s: when the gateway received the request (the clock's seconds).
    """

    __slots__ = ("start_s", "first_content_s", "last_content_s", "itl_s", "usage", "done", "_pending")

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.first_content_s: float | None = None
        self.last_content_s: float | None = None
        self.itl_s: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.done = False  # a `data: [DONE]` event was seen (and returned for relaying)
        self._pending = b""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content_s is None else self.first_content_s - self.start_s

    @property
    def holding(self) -> bool:
        """Bytes of an incomplete event are held back."""
        return bool(self._pending)

    def feed(self, chunk: bytes, now_s: float) -> bytes:
        """Take one network read received at ``now_s``; return the bytes to relay now (every
        complete event so far, as received), holding back an incomplete one."""
        data = self._pending + chunk if self._pending else chunk
        end = -1
        for match in _BLANK_LINE.finditer(data):
            end = match.end()
        if end < 0:
            if len(data) > _MAX_PENDING_BYTES:  # not SSE-shaped: pass it on, uninspected
                self._pending = b""
                return data
            self._pending = data
            return b""
        self._pending = data[end:]
        content = False
        for event in _events(data[:end]):
            content |= self._event(event)
        if content:
            if self.first_content_s is None:
                self.first_content_s = now_s
            elif self.last_content_s is not None:
                self.itl_s.append(now_s - self.last_content_s)
            self.last_content_s = now_s
        return data[:end]

    def flush(self) -> bytes:
        """At a clean end of stream: the bytes still held back (an event left unterminated)."""
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, payload: bytes) -> bool:
        """Handle one event's data; True if it carried generated content."""
        if payload == b"[DONE]":
            self.done = True
            return False
        has_usage = b'"usage"' in payload
        if self.first_content_s is not None and not has_usage:
            return True  # after the first token, any data event is a content chunk; skip parsing
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        if has_usage and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        return _has_content(obj)


def _events(block: bytes) -> list[bytes]:
    """The data payloads of the complete events in ``block`` (which ends with an empty line)."""
    events: list[bytes] = []
    data: list[bytes] = []
    for line in _LINE_END.split(block):
        if not line:  # an empty line dispatches the event (one with no data is dropped)
            if data:
                events.append(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return events


def leading_error(first: bytes) -> str | None:
    """The message of the error event a stream's first bytes open with (vLLM's failed request:
    ``data: {"error": …}``, then ``[DONE]``), or ``None`` when they open with anything else or
    their first event is not complete yet."""
    if not first.lstrip().startswith(b"data:"):
        return None
    cut = max(first.rfind(b"\n\n"), first.rfind(b"\r\n\r\n"), first.rfind(b"\r\r"))
    events = _events(first[:cut] + b"\n\n") if cut >= 0 else []
    if not events:
        return None
    try:
        obj = orjson.loads(events[0])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return None
    return str(obj["error"].get("message", "an error event"))


def _has_content(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")
                                        or delta.get("reasoning_content") or delta.get("reasoning")):
            return True
    return False


def usage_from_body(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-streamed JSON response, or None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def error_tail(message: str, error_type: str, status: int) -> bytes:
    """The SSE tail that ends a stream the gateway must end itself: an OpenAI error event, then
    ``data: [DONE]`` (vLLM's shape for a failed stream)."""
    return b"data: " + orjson.dumps(error_body(message, error_type, status)) + b"\n\n" + DONE_EVENT
