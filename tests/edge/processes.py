"""A gateway and its mock fleet as child processes on 127.0.0.1, for the edge tests.

Child processes rather than uvicorn threads: hypothesis raises the interpreter's recursion
limit while it runs a test (``ensure_free_stackframes``), and the limit is process-wide, so a
gateway in a thread of the test process would encode JSON far deeper than a deployed one
does — exactly the failure the fuzz looks for. Only the processes started here are stopped,
by their `Popen` handles.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import yaml

from gateway.commands.processes import answers_ok, free_port, stop_processes
from tests.integration.gateway_support import MOCK_MODEL, poll

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
MOCK_TIME_SCALE = 0.001  # modelled seconds → wall: 1,000× faster than real time


@contextmanager
def _child(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", *args], cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        stop_processes([proc])


def _healthy_backends(url: str, proc: subprocess.Popen, log: Path) -> int:
    if proc.poll() is not None:
        raise AssertionError(f"the gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return sum(b["healthy"] for b in httpx.get(url + "/v1/kappa/backends", timeout=2).json()["backends"])
    except httpx.HTTPError:
        return 0


@contextmanager
def gateway_process(workdir: Path, hardware: tuple[str, ...] = ("h100-sxm", "b200")) -> Iterator[str]:
    """``kappa-gateway mock-fleet`` (one mock per ``hardware``, llama-3.1-8b) and ``kappa-gateway
    serve`` (memory index, fast health checks) on free loopback ports, until the block exits;
    yields the gateway's base URL once every backend is healthy. Logs go to ``workdir``."""
    port = free_port()
    backends = [{"id": f"m{i}", "url": f"http://127.0.0.1:{free_port()}", "model": MOCK_MODEL, "hardware": hw}
                for i, hw in enumerate(hardware)]
    config = workdir / "fleet.yaml"
    config.write_text(yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 0.5, "scrape_interval_s": 0.5,
                    "shutdown_drain_delay_s": 0, "graceful_shutdown_timeout_s": 1},
        "backends": backends}, sort_keys=False))
    url = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        stack.enter_context(_child(["mock-fleet", "--config", str(config), "--time-scale", str(MOCK_TIME_SCALE)],
                                   workdir / "mocks.log"))
        poll(lambda: all(answers_ok(b["url"] + "/health") for b in backends), "the mocks to answer",
             timeout_s=START_TIMEOUT_S)
        log = workdir / "gateway.log"
        proc = stack.enter_context(_child(["serve", "--config", str(config), "--log-level", "warning"], log))
        poll(lambda: _healthy_backends(url, proc, log) == len(backends), "every backend healthy at the gateway",
             timeout_s=START_TIMEOUT_S)
        yield url
