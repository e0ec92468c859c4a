"""The command line's processes as an operator drives them: signals, dead children, defaults.

Real child processes on 127.0.0.1, signalled by the pids this test started them with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.commands.processes import free_port, stop_processes
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll
from tests.reliability.relay_support import CHAT, REPO_ROOT, get_status, raw_request, refused
from tests.support.misbehaving_upstream import misbehaving_upstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def config_file(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "gateway", *args], cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    stop_processes([proc])


def two_backends() -> list[dict]:
    return [{"id": bid, "url": f"http://127.0.0.1:{free_port()}", "model": MOCK_MODEL, "hardware": "h100-sxm"}
            for bid in ("a", "b")]


def test_mock_vllm_with_config_listens_where_its_backend_entry_says(tmp_path: Path) -> None:
    """Regression: --config/--backend ignored the entry's URL and bound the default port 8001."""
    backends = two_backends()
    config = config_file(tmp_path, {"backends": backends})
    proc = start(["mock-vllm", "--config", str(config), "--backend", "b", "--log-level", "warning"], tmp_path / "log")
    try:
        poll(lambda: proc.poll() is None and get_status(backends[1]["url"], "/health") == 200,
             "the mock to answer at its entry's URL", timeout_s=20)
        assert get_status(backends[0]["url"], "/health") is None  # not where the other backend lives
    finally:
        stop(proc)


def start_fleet(tmp_path: Path) -> tuple[list[dict], Path, subprocess.Popen, dict[str, str]]:
    """`mock-fleet` over two backends (no kv_pool: a process each), both answering: (backends, its log,
    the process this test started, backend id -> its mock's pid)."""
    backends = two_backends()
    config = config_file(tmp_path, {"backends": backends})
    log = tmp_path / "fleet.log"
    fleet = start(["mock-fleet", "--config", str(config), "--time-scale", "0.01"], log)
    try:
        pids = poll(lambda: dict(re.findall(r"^(\w+): .* \(pid (\d+)\)$", log.read_text(), re.M)) or None,
                    "the fleet to print its mocks' pids", timeout_s=30)
        poll(lambda: all(get_status(b["url"], "/health") == 200 for b in backends), "both mocks up", timeout_s=30)
    except BaseException:
        stop(fleet)
        raise
    return backends, log, fleet, pids


def test_one_dead_mock_leaves_the_rest_of_the_fleet_serving(tmp_path: Path) -> None:
    """Regression: kill -9 of one mock of `mock-fleet` (no kv_pool: a process each) stopped
    every other mock and exited 0 without a word."""
    backends, log, fleet, pids = start_fleet(tmp_path)
    try:
        os.kill(int(pids["a"]), signal.SIGKILL)  # a mock process started (through mock-fleet) by this test
        poll(lambda: "mock a (pid" in log.read_text(), "the fleet to report the dead mock", timeout_s=10)
        assert "exited with -9" in log.read_text()
        assert fleet.poll() is None and get_status(backends[1]["url"], "/health") == 200
    finally:
        stop(fleet)
    assert get_status(backends[1]["url"], "/health") is None  # stopping the fleet stops its mocks


def test_a_third_signal_forces_the_exit_and_says_so_in_the_exit_code(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with misbehaving_upstream({"x-scenario": "silent"}) as up:  # holds the request: the grace period waits on it
        config = config_file(tmp_path, {"gateway": {"port": port, "shutdown_drain_delay_s": 30},
                                        "backends": [backend_doc("a", up.url)]})
        proc = start(["serve", "--config", str(config), "--log-level", "warning"], tmp_path / "log")
        try:
            poll(lambda: proc.poll() is None and get_status(url, "/ready") == 200, "the gateway to be ready",
                 timeout_s=20)
            assert httpx.head(url + "/health").status_code == 200
            with raw_request(url, CHAT):
                poll(lambda: up.posts, "the request to reach the backend", timeout_s=5)
                os.kill(proc.pid, signal.SIGTERM)  # the drain
                poll(lambda: get_status(url, "/ready") == 503, "the drain to start", timeout_s=5)
                os.kill(proc.pid, signal.SIGTERM)  # the listener closes now; the request in flight holds on
                poll(lambda: refused(url), "the listener to close", timeout_s=5)
                assert proc.poll() is None
                os.kill(proc.pid, signal.SIGTERM)  # forced
                assert proc.wait(timeout=10) == 1
        finally:
            stop(proc)


def test_mock_fleet_killed_with_sigkill_takes_its_mocks_with_it(tmp_path: Path) -> None:
    """Regression (newcomer trial, issue 30): `kill -9` of `mock-fleet` left its worker serving the
    mocks, re-parented to init, holding their HTTP and KV-event ports, so the fleet could not start again."""
    backends, log, fleet, pids = start_fleet(tmp_path)
    try:
        os.kill(fleet.pid, signal.SIGKILL)  # the mock-fleet process this test started
        fleet.wait(timeout=10)
        poll(lambda: all(get_status(b["url"], "/health") is None for b in backends), "the orphaned mocks to stop",
             timeout_s=15)
        for pid in {int(p) for p in pids.values()}:  # the workers this fleet started are gone, not just deaf
            poll(lambda pid=pid: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
                 f"worker {pid} to exit", timeout_s=15)
    finally:
        if fleet.poll() is None:
            stop(fleet)
