"""``serve --workers 2``: two gateway processes on one port, one /metrics, one clean stop.

A real ``kappa-gateway serve --workers 2`` process tree on a real Redis in front of a real
fake upstream; signals to pids this test started (the parent) or read from the gateway
(a worker's pid, killed to see it replaced).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.commands.processes import free_port, stop_processes
from gateway.telemetry.metrics import REFRESH_INTERVAL_S
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, redis_index
from tests.reliability.relay_support import REPO_ROOT, get_status, refused
from tests.support.fake_upstream import Script, make_app
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(120)]

BODY = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def worker_ids(url: str, n: int) -> set[str]:
    """Replica ids answering ``n`` fresh connections (each id names its worker's pid)."""
    ids = set()
    for _ in range(n):
        with httpx.Client(timeout=10) as fresh:
            ids.add(fresh.get(f"{url}/v1/kappa/backends").json()["peers"]["replica_id"])
    return ids


@contextmanager
def two_workers(script: Script, redis_url: str, key_prefix: str, tmp_path: Path,
                **gateway: object) -> Iterator[tuple[str, subprocess.Popen]]:
    """``serve --workers 2`` on a Redis index in front of a fake upstream running ``script``, ready;
    yields its URL and the parent process (stopped on the way out)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_in_thread(make_app(script)) as upstream, redis_index(redis_url, key_prefix) as index:
        config = tmp_path / "fleet.yaml"
        config.write_text(yaml.safe_dump({"gateway": {"port": port, "shutdown_drain_delay_s": 0.5,
                                                      "health_interval_s": 0.2, **gateway},
                                          "index": index, "backends": [backend_doc("b0", upstream)]}))
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        log = (tmp_path / "serve.log").open("wb")
        parent = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--workers", "2",
                                   "--log-level", "warning"], cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        try:
            poll(lambda: get_status(url, "/ready") == 200, "the workers to be ready", timeout_s=40)
            yield url, parent
        finally:
            stop_processes([parent])
            log.close()


def test_two_workers_share_one_port_one_metrics_page_and_stop_cleanly(redis_url: str, key_prefix: str,
                                                                     tmp_path: Path) -> None:
    with two_workers(Script(), redis_url, key_prefix, tmp_path) as (url, parent):
        poll(lambda: metric(url, "gateway_peer_replicas") == 2, "each worker to see the other", timeout_s=20)
        for _ in range(20):
            with httpx.Client(timeout=10) as fresh:  # a new connection each: both workers take some
                assert fresh.post(f"{url}/v1/chat/completions", json=BODY).status_code == 200
        # Whichever worker answers /metrics, it reports every worker's requests: its own at
        # once, the other's as of that worker's last flush, at most REFRESH_INTERVAL_S ago
        # (gateway.telemetry.metric_values) ...
        poll(lambda: metric(url, "gateway_requests_total", status="ok") == 20, "both workers' counts on /metrics",
             timeout_s=3 * REFRESH_INTERVAL_S)
        # ... and every worker, then, reports all of them.
        for _ in range(4):  # a new connection each (metric): both workers answer some
            assert metric(url, "gateway_requests_total", status="ok") == 20
        def both() -> set[str] | None:
            found = worker_ids(url, 10)
            return found if len(found) == 2 else None

        ids = poll(both, "both workers to accept connections", timeout_s=30)
        # A worker killed outright is replaced; the port keeps serving meanwhile.
        victim = int(sorted(ids)[0].split("-")[-2])
        os.kill(victim, signal.SIGKILL)
        poll(lambda: len(worker_ids(url, 10) - ids) >= 1, "a replacement worker", timeout_s=40)
        assert httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=10).status_code == 200
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0  # every worker drained and exited 0
        assert get_status(url, "/health") is None  # nothing listens any more


def test_after_the_drain_a_stopping_gateway_refuses_new_connections_while_a_stream_finishes(
        redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """Past the drain delay the port is closed, although a worker still relays a stream in its
    grace period: a new connection is refused at once, as with one process. Before, the parent's
    copies of the listening sockets kept the port open, and the kernel queued connections that
    nobody accepted until the last worker exited."""
    slow = Script(chunks=300, chunk_delay_s=0.05)  # a 15 s stream
    with two_workers(slow, redis_url, key_prefix, tmp_path, graceful_shutdown_timeout_s=30) as (url, parent):
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as resp:
            chunks = resp.iter_raw()
            assert next(chunks).startswith(b"data: ")
            parent.send_signal(signal.SIGTERM)
            poll(lambda: refused(url), "the port to refuse new connections after the drain", timeout_s=5)
            assert parent.poll() is None  # the stream's worker is still in its grace period
            assert b"".join(chunks).rstrip().endswith(b"data: [DONE]")  # and the stream ends whole
        assert parent.wait(timeout=60) == 0


def test_workers_that_outlive_the_stop_bound_are_killed_and_the_exit_says_so() -> None:
    """A worker hung in its shutdown must not hold the service (and a rollout) for ever: past
    drain + grace + margins the supervisor kills it and exits 1, as Kubernetes would."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.stubborn_workers", "1.0"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                                    if k != "PROMETHEUS_MULTIPROC_DIR"})
    try:
        pids = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1
        for pid in pids:  # gone, not orphaned
            poll(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or
                 Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", f"worker {pid} to be gone")
    finally:
        stop_processes([proc])
        proc.stdout.close()


def test_a_stop_while_the_workers_start_ends_them_cleanly(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """SIGTERM before the workers serve (Kubernetes may stop a pod that is still starting): each
    worker exits 0 and so does the supervisor. Before, a worker still importing died by the signal
    (status -15) and `serve` exited 1 ("workers exited with statuses [0, -15]")."""
    with serve_in_thread(make_app(Script())) as upstream, redis_index(redis_url, key_prefix) as index:
        config = tmp_path / "fleet.yaml"
        config.write_text(yaml.safe_dump({"gateway": {"port": free_port(), "shutdown_drain_delay_s": 0.5},
                                          "index": index, "backends": [backend_doc("b0", upstream)]}))
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        parent = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--workers", "2",
                                   "--log-level", "warning"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            def children() -> list[str]:
                return [c for t in os.listdir(f"/proc/{parent.pid}/task")
                        for c in Path(f"/proc/{parent.pid}/task/{t}/children").read_text().split()]

            def workers_running_python() -> bool:  # spawned and past exec: importing the gateway
                return sum("python" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")
                           for c in children() if os.path.exists(f"/proc/{c}")) >= 2
            poll(workers_running_python, "the two workers to be spawned", timeout_s=30)
            parent.send_signal(signal.SIGTERM)
            assert parent.wait(timeout=30) == 0, parent.stdout.read() if parent.stdout else ""
        finally:
            stop_processes([parent])
            if parent.stdout:
                parent.stdout.close()
