"""A minimal OpenAI-shaped upstream that answers at once, on several loopback ports in one process.

Used by ``bench/overhead.py`` as the backend of every configuration (direct, bare proxy,
gateway), so that what differs between them is only the proxy in the middle. It is a raw
ASGI app on uvicorn (uvloop + httptools), without a framework, to keep its own cost small
and equal for everyone. It imports none of the project's packages.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: reads the whole body; a body
  with ``"stream": true`` gets a short SSE stream (three content events, a usage event,
  ``[DONE]``), any other body one JSON completion. ``usage.prompt_tokens`` is the body's
  length / 4 (the gateway calibrates bytes per token from it). The bench's own bodies put
  ``stream`` first, so their first bytes decide; a body that a router re-serialised
  (sglang-router and vllm-router move ``stream`` after the messages) is searched whole.
- ``GET /health``: 200. ``GET /metrics``: a minimal vLLM-style page (an idle engine).

    python bench/upstream_stub.py --listeners 8     # prints {"ports": [...]} once listening
    python bench/upstream_stub.py --port 8123       # listens on the given port(s) instead
"""

from __future__ import annotations

import argparse
import json
import socket

import uvicorn

from prefix_index.hashing import BYTES_PER_TOKEN_ESTIMATE  # the bench's prompts are ~this many bytes per token

# A JSON string cannot hold these bytes (its quotes are escaped), so a match is the key itself;
# compact (Rust serde_json, the bench) and Python json.dumps spacing.
STREAM_TRUE = (b'"stream":true', b'"stream": true')
STREAM_FALSE = (b'"stream":false', b'"stream": false')
STREAM_MARK_WINDOW_BYTES = 64  # the load generator writes "stream" as the body's first key
CONTENT_EVENTS = 3

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
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


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


def _usage(body_bytes: int) -> dict:
    prompt = max(int(body_bytes // BYTES_PER_TOKEN_ESTIMATE), 1)
    return {"prompt_tokens": prompt, "completion_tokens": CONTENT_EVENTS, "total_tokens": prompt + CONTENT_EVENTS,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    payload = {"id": "cmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
               "choices": choices}
    if usage is not None:
        payload["usage"] = usage
    return _event(payload)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path in ("/v1/chat/completions", "/v1/completions") and scope["method"] == "POST":
        body = await _read_body(receive)
        usage = _usage(len(body))
        if wants_stream(body):
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            for i in range(CONTENT_EVENTS):
                finish = "length" if i == CONTENT_EVENTS - 1 else None
                await send({"type": "http.response.body", "body": _chunk(f"t{i}", finish), "more_body": True})
            await send({"type": "http.response.body", "body": _chunk(None, usage=usage) + b"data: [DONE]\n\n"})
            return
        out = json.dumps({"id": "cmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "t0 t1 t2"},
                                       "finish_reason": "length"}], "usage": usage}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": out})
        return
    if path == "/health":
        status, body, headers = 200, b"{}", _JSON
    elif path == "/metrics":
        status, body, headers = 200, METRICS_PAGE, [(b"content-type", b"text/plain; version=0.0.4")]
    else:
        status, body, headers = 404, b'{"error":"not found"}', _JSON
    await _read_body(receive)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
    print(json.dumps({"ports": [s.getsockname()[1] for s in sockets]}), flush=True)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="off", access_log=False,
                            log_level="warning", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
