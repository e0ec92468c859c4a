"""Liveness apart from admission, secrets kept out of logs, and a killed worker's streams (issue 28
items 4, 7b, 7c).

``python -m gateway serve`` as a child process on 127.0.0.1 (the admin listener and the log
configuration are the served process's, not a test thread's), in front of a real fake
upstream. Before issue 28's edge work there was no admin listener (the first test's probe is
refused), and a query string's ``api_key`` reached the trace log: those tests fail there. The
SIGKILL test documents what a client sees when a worker dies under it (a transport error); it
passed before too, and guards that no change makes the end look clean.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.commands.processes import free_port, stop_processes
from tests.edge.test_connections import REQUEST, connect, read_response
from tests.integration.gateway_support import backend_doc, poll, run_fakes
from tests.support.fake_upstream import Script

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
HEALTH_BOUND_S = 0.1


@contextmanager
def serve(workdir: Path, upstream: str, *args: str, **gateway: object) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """``serve`` over one fake backend; yields (base URL, the process, its log) once ready."""
    port = free_port()
    config = workdir / "fleet.yaml"
    config.write_text(yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 0.2, "scrape_interval_s": 0.2,
                    "shutdown_drain_delay_s": 0, "graceful_shutdown_timeout_s": 1, **gateway},
        "backends": [backend_doc("b0", upstream)]}))
    log = workdir / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), *args],
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        poll(ready, "the gateway to be ready", timeout_s=START_TIMEOUT_S)
        yield url, proc, log
    finally:
        stop_processes([proc])


def test_at_the_connection_cap_health_answers_on_the_admin_port_and_ready_says_saturated(tmp_path: Path) -> None:
    admin = free_port()
    with run_fakes([Script()]) as (upstream,), \
            serve(tmp_path, upstream, "--log-level", "warning", admin_port=admin, max_client_connections=4,
                  client_header_timeout_s=30.0) as (url, _, _), ExitStack() as stack:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(4):  # the cap, held by connections mid-head (not idle: none can be reclaimed)
            stack.enter_context(connect(("127.0.0.1", port))).sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        refused = stack.enter_context(connect(("127.0.0.1", port)))
        refused.sendall(REQUEST)
        assert read_response(refused)[0] == 503, "the proxy listener is at its cap"
        with httpx.Client(base_url=f"http://127.0.0.1:{admin}", timeout=5) as probe:
            for _ in range(5):
                started = time.monotonic()
                assert probe.get("/health").status_code == 200
                assert time.monotonic() - started < HEALTH_BOUND_S * 5  # loaded 2-core machine: 5x slack
            ready = probe.get("/ready")
            assert ready.status_code == 503 and ready.json()["saturated"] is True and "cap" in ready.json()["reason"]
            assert probe.get("/metrics").status_code == 200
            assert probe.post("/v1/chat/completions", json={}).status_code == 404, "operator paths only"


def test_below_the_cap_ready_is_200_on_both_listeners(tmp_path: Path) -> None:
    admin = free_port()
    with run_fakes([Script()]) as (upstream,), \
            serve(tmp_path, upstream, "--log-level", "warning", admin_port=admin, max_client_connections=2) as (url, _, _):
        for base in (url, f"http://127.0.0.1:{admin}"):
            ready = httpx.get(base + "/ready", timeout=5)
            assert ready.status_code == 200 and ready.json()["saturated"] is False, ready.text


def test_a_query_string_secret_never_reaches_the_trace_log(tmp_path: Path) -> None:
    with run_fakes([Script()]) as (upstream,), serve(tmp_path, upstream, "--log-level", "trace") as (url, _, log):
        assert httpx.get(url + "/v1/models?api_key=sk-live-secret-123&x=1", timeout=5).status_code == 200
        poll(lambda: "/v1/models" in log.read_text(), "the request to be logged")
        text = log.read_text()
        assert "uvicorn.asgi" in text or "ASGI" in text, "trace level logs the ASGI scope"
        assert "sk-live-secret-123" not in text
        assert "<redacted>" in text


def _worker_holding(ports: tuple[int, int], pids: list[int]) -> int:
    """The pid among ``pids`` whose open sockets include the TCP connection with these ports."""
    local = ":%04X" % ports[0]
    remote = ":%04X" % ports[1]
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if {fields[1][-5:], fields[2][-5:]} == {local, remote}:
            inodes.add(fields[9])
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker holds the connection {ports}")


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_sigkill_of_the_worker_serving_a_stream_is_a_transport_error_never_a_clean_end(tmp_path: Path) -> None:
    with run_fakes([Script(chunks=400, chunk_delay_s=0.05)]) as (upstream,), \
            serve(tmp_path, upstream, "--log-level", "warning", "--workers", "2") as (url, proc, _):
        port = int(url.rsplit(":", 1)[1])
        poll(lambda: len(_children(proc.pid)) >= 2, "both workers to run")
        body = {"model": "llama-3.1-8b", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=10) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            sock = resp.extensions["network_stream"].get_extra_info("socket")
            victim = _worker_holding((sock.getsockname()[1], port), _children(proc.pid))
            os.kill(victim, signal.SIGKILL)
            seen = []
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                for line in lines:
                    seen.append(line)
            assert "data: [DONE]" not in seen and not any('"error"' in s for s in seen)
