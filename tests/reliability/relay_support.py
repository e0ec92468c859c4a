"""Helpers for the relay fault tests (issue 12): a client that keeps every byte it receives,
the SSE error tail, a raw-socket client, and gateway or upstream child processes.

Gateways in a thread come from `tests.integration.gateway_support.run_gateway`; this module
adds only what that one lacks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.commands.processes import stop_processes
from tests.integration.gateway_support import MOCK_MODEL, poll
from tests.support.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
STREAM = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
CLIENT_TIMEOUT_S = 5.0  # every exchange is bounded: a gateway that hangs fails the test, not the run
DONE = b"data: [DONE]\n\n"
PROCESS_START_TIMEOUT_S = 20.0


@dataclass
class Received:
    """What a client got: status, headers, every body byte as it came, and how the body ended."""

    status: int
    headers: httpx.Headers
    body: bytes
    error: str | None  # None: a complete, terminated body; else the httpx error that cut it
    started_s: float  # time.monotonic() when the request was sent
    ended_s: float  # … and when the body ended

    @property
    def elapsed_s(self) -> float:
        return self.ended_s - self.started_s

    def json(self) -> Any:
        return json.loads(self.body)


def exchange(url: str, body: dict | bytes, headers: dict[str, str] | None = None, *,
             path: str = "/v1/chat/completions", timeout_s: float = CLIENT_TIMEOUT_S) -> Received:
    """POST ``body`` and keep the raw body bytes (``iter_raw``: no decoding, no re-framing).

    Raises:
        AssertionError: no response headers within ``timeout_s``.
    """
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    chunks: list[bytes] = []
    error = None
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        try:
            with client.stream("POST", path, content=content,
                               headers={"content-type": "application/json", **(headers or {})}) as resp:
                try:
                    chunks.extend(resp.iter_raw())  # keeps the pieces that came before an error
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
        except httpx.TimeoutException as exc:
            raise AssertionError(f"no response within {timeout_s} s ({type(exc).__name__})") from exc
    return Received(resp.status_code, resp.headers, b"".join(chunks), error, started, time.monotonic())


def split_error_tail(body: bytes) -> tuple[bytes, dict]:
    """``(bytes before the tail, the error object)`` of a body ending in
    ``data: {"error": …}\\n\\ndata: [DONE]\\n\\n``. Raises AssertionError if it does not."""
    assert body.endswith(b"\n\n" + DONE), f"no error tail: the body ends {body[-120:]!r}"
    head = body[: -len(b"\n\n" + DONE)]
    start = head.rfind(b"data: ")
    assert start >= 0 and (start == 0 or head[:start].endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))), \
        f"the error event does not start an event: {body[-200:]!r}"
    error = json.loads(head[start + len(b"data: "):])
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    assert isinstance(error["error"]["message"], str) and error["error"]["message"], error
    return body[:start], error["error"]


def assert_error_tail(body: bytes, before: bytes, error_type: str, code: int) -> None:
    """``body`` is exactly ``before`` then an OpenAI error event of ``error_type``/``code`` and ``[DONE]``."""
    got_before, error = split_error_tail(body)
    assert got_before == before, f"bytes before the error tail differ:\n{got_before!r}\n!=\n{before!r}"
    assert (error["type"], error["code"], error["param"]) == (error_type, code, None), error


def assert_openai_error(got: Received, status: int, error_type: str) -> None:
    assert got.status == status, (got.status, got.body[:300])
    error = got.json()["error"]
    assert (error["type"], error["code"]) == (error_type, status), error


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(url: str, body: dict, headers: dict[str, str] | None = None,
                path: str = "/v1/chat/completions") -> socket.socket:
    """Send one request on a fresh socket and return the socket unread (the caller closes it)."""
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    sock = socket.create_connection(host_port(url), timeout=CLIENT_TIMEOUT_S)
    sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
    return sock


def refused(url: str) -> bool:
    """True if a new TCP connection to ``url`` is refused."""
    try:
        socket.create_connection(host_port(url), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


def get_status(url: str, path: str) -> int | None:
    """Status of GET ``path`` on a new connection; None if it cannot connect."""
    try:
        return httpx.get(url + path, timeout=1.0).status_code
    except httpx.TransportError:
        return None


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def gateway_process(tmp_path: Path, doc: dict) -> Iterator[GatewayProcess]:
    """``python -m gateway serve --config <doc as YAML>`` on a free port, ready (``/ready`` 200).
    The process is ours: killed (by its pid) if still running at the end."""
    port = free_port()
    doc = {**doc, "gateway": {"host": "127.0.0.1", "port": port, **doc.get("gateway", {})}}
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                 "--log-level", "warning"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    gw = GatewayProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"the gateway exited with {proc.returncode}:\n{gw.log_text()}"
            return get_status(gw.url, "/ready") == 200
        poll(ready, "the gateway process to be ready", timeout_s=PROCESS_START_TIMEOUT_S)
        yield gw
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextmanager
def upstream_process() -> Iterator[tuple[subprocess.Popen, str]]:
    """`tests.support.misbehaving_upstream` as a child process (one a test may SIGSTOP);
    always SIGCONT-ed and ended (by its pid) at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.misbehaving_upstream", str(port)], cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"the upstream process exited with {proc.returncode}"
            return get_status(url, "/health") == 200
        poll(up, "the upstream process to answer /health", timeout_s=PROCESS_START_TIMEOUT_S)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop_processes([proc], timeout_s=5)
