"""Relaying a response to the client unchanged while watching it go by.

Streams pass through chunk by chunk as they arrive, never buffered or re-chunked. On the
side, `SseObserver` splits the bytes into SSE events (``data: …\\n\\n``) to find the first
content chunk (TTFT), the gaps between content chunks (ITL) and the final ``usage`` object
(``stream_options.include_usage``), without changing what the client receives. If the
backend fails mid-stream, the client gets an explicit ``data: {"error": …}`` event and
``data: [DONE]`` — as vLLM itself ends a failed stream (REFERENCE.md §3) — never a silent
truncation.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import error_body

_EVENT_END = b"\n\n"
_MAX_PENDING_BYTES = 1 << 20  # an event larger than 1 MiB is not inspected (still relayed)


class SseObserver:
    """Watches SSE bytes: first content time, inter-chunk gaps, usage, [DONE].

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
        self.done = False
        self._pending = b""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content_s is None else self.first_content_s - self.start_s

    def feed(self, chunk: bytes, now_s: float) -> None:
        """Inspect one network chunk received at ``now_s``."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data if len(data) <= _MAX_PENDING_BYTES else b""
            return
        self._pending = data[end + 2:]
        content = False
        for event in data[:end].split(_EVENT_END):
            content |= self._event(event)
        if content:
            if self.first_content_s is None:
                self.first_content_s = now_s
            elif self.last_content_s is not None:
                self.itl_s.append(now_s - self.last_content_s)
            self.last_content_s = now_s

    def _event(self, event: bytes) -> bool:
        """Handle one SSE event; True if it carried generated content."""
        payload = event.strip()
        if not payload.startswith(b"data:"):
            return False
        payload = payload[5:].strip()
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


def midstream_error_event(message: str) -> bytes:
    """The SSE tail sent when the backend fails after the stream started (then the stream ends)."""
    return b"data: " + orjson.dumps(error_body(message, "upstream_error", 502)) + b"\n\ndata: [DONE]\n\n"
