"""Issue 30's fault list with real processes: a mock started as ``kappa-gateway mock-vllm --config ...``
(its backend entry's ``kv_events`` bound on loopback ports, the shipped tokenizer) under a real gateway,
beside an in-process plain mock. Signals go only to the process this test started, by its pid.

* the engine killed (SIGKILL) and started again on the same ports: a new event stream; the gateway
  drops the old entries and takes up the new stream, and requests meanwhile go to the other backend;
* the event endpoint down when the gateway starts: ``approximate`` and one log line, then ``exact``
  once the mock is up;
* the engine stopped (SIGSTOP) for a few seconds, then continued (SIGCONT): back in sync.

Each ends with the gateway's exact index holding exactly the new engine's resident blocks
(`kv_events_support.assert_index_is_engine`) and no request through the gateway failing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.commands.processes import free_port, stop_processes
from tests.integration.gateway_support import MOCK_MODEL, Gateway, backend_doc, poll, run_gateway, run_mocks
from tests.integration.kv_events_support import (
    BLOCKS,
    SPEC,
    Prompts,
    Traffic,
    assert_index_is_engine,
    kv_view,
    wait_exact,
)
from router.capacity import kv_block_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "kappa-mock-bpe"
MODELS = {MOCK_MODEL: {"profile": MOCK_MODEL, "tokenizer": str(TOKENIZER_DIR)}}
START_TIMEOUT_S = 30.0
STOP_S = 3.0  # how long the engine stays stopped: the fault itself, not a wait for readiness


def event_backend() -> dict:
    """b0: 24 HBM blocks, an 8-block host tier, KV events on free loopback ports."""
    host_gb = 8.5 * kv_block_bytes(SPEC, 16) / 1e9  # 8 whole blocks
    return backend_doc("b0", f"http://127.0.0.1:{free_port()}", num_gpu_blocks_override=24, host_tier_gb=host_gb,
                       kv_events={"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                  "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})


class MockProcess:
    """``kappa-gateway mock-vllm --config`` for one backend entry; `start` again after a kill reuses its ports."""

    def __init__(self, tmp_path: Path, entry: dict) -> None:
        self.entry = entry
        self.config = tmp_path / "mock.yaml"
        self.config.write_text(yaml.safe_dump({"backends": [entry], "models": MODELS}))
        self.log = tmp_path / "mock.log"
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=entry["url"], timeout=30)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "mock-vllm", "--config", str(self.config), "--backend", "b0",
                 "--time-scale", "0.001", "--log-level", "warning"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        poll(self._ready, "the mock process to answer", timeout_s=START_TIMEOUT_S)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            return self.http.get(BLOCKS, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)  # the process this test started

    def complete(self, tokens: list[int]) -> None:
        r = self.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot take SIGTERM
            stop_processes([self.proc])
        self.http.close()


@contextmanager
def rig(tmp_path: Path, *, start_mock: bool = True) -> Iterator[tuple[MockProcess, Gateway, Traffic]]:
    mock = MockProcess(tmp_path, event_backend())
    try:
        if start_mock:
            mock.start()
        with run_mocks(1) as (plain,), run_gateway([mock.entry, backend_doc("b1", plain)], models=MODELS) as gw:
            yield mock, gw, Traffic(gw)
    finally:
        mock.close()


def test_an_engine_killed_and_restarted_is_a_new_stream_and_no_request_fails(tmp_path: Path) -> None:
    prompts = Prompts(seed=32)
    with rig(tmp_path) as (mock, gw, traffic):
        wait_exact(gw, "b0", timeout_s=START_TIMEOUT_S)
        for _ in range(30):
            mock.complete(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0")
        old_blocks = kv_view(gw, "b0")["exact_blocks"]["hbm"]

        mock.signal(signal.SIGKILL)
        assert mock.proc is not None and mock.proc.wait(timeout=10) == -signal.SIGKILL
        for _ in range(10):  # the outage, at once: b0 refuses connections before its health check says so
            traffic.send(prompts.next())
        poll(lambda: kv_view(gw, "b0")["mode"] == "approximate", "b0 approximate: its publisher is gone")
        mock.start()  # the same HTTP and ZMQ ports, a new event stream from seq 0
        for _ in range(5):
            mock.complete(prompts.next())
            traffic.send(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0", timeout_s=START_TIMEOUT_S)
        assert kv_view(gw, "b0")["exact_blocks"]["hbm"] < old_blocks  # the dead engine's blocks are gone
        assert traffic.failed == 0, traffic.statuses
        # Every attempt that met the dead engine was retried on b1 (the gateway's rule for a refused connection).
        assert gw.metric("gateway_upstream_retries_total") == gw.metric("gateway_upstream_failures_total")


def test_an_endpoint_down_at_start_is_approximate_with_one_line_then_exact(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kappa_gateway.kv_events")
    prompts = Prompts(seed=33)
    with rig(tmp_path, start_mock=False) as (mock, gw, traffic):
        endpoint = mock.entry["kv_events"]["endpoint"]
        poll(lambda: f"no publisher at {endpoint}" in caplog.text, "the log line", timeout_s=START_TIMEOUT_S)
        assert kv_view(gw, "b0")["mode"] == "approximate"
        for _ in range(5):
            traffic.send(prompts.next())
        mock.start()
        wait_exact(gw, "b0", timeout_s=START_TIMEOUT_S)
        for _ in range(10):
            mock.complete(prompts.next())
            traffic.send(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0")
        assert traffic.failed == 0, traffic.statuses
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "kappa_gateway.kv_events" and r.levelno >= logging.WARNING and "backend b0" in r.getMessage()]
    assert len(warnings) == 1 and f"no publisher at {endpoint}" in warnings[0], warnings


def test_an_engine_stopped_for_seconds_comes_back_in_sync(tmp_path: Path) -> None:
    prompts = Prompts(seed=34)
    with rig(tmp_path) as (mock, gw, traffic):
        wait_exact(gw, "b0", timeout_s=START_TIMEOUT_S)
        for _ in range(20):
            mock.complete(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0")
        mock.signal(signal.SIGSTOP)
        resume = threading.Timer(STOP_S, mock.signal, (signal.SIGCONT,))
        resume.start()  # continues the engine even while a request below waits on it
        try:
            deadline = time.monotonic() + STOP_S
            while time.monotonic() < deadline:  # requests while the engine is stopped
                traffic.send(prompts.next())
        finally:
            resume.join()
        for _ in range(10):
            mock.complete(prompts.next())
            traffic.send(prompts.next())
        assert_index_is_engine(gw, mock.http, "b0")
        assert traffic.failed == 0, traffic.statuses
