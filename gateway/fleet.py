"""Starting the mock backends a config file names, as child processes (``kappa-gateway mock-fleet``).

Each backend whose URL is on this machine becomes one ``kappa-gateway mock-vllm`` process
with that backend's model, hardware, TP, power cap and host tier, so ``serve`` has a fleet
to route to without Docker or GPUs. Readiness is polled on each ``/health``; the processes
are ended by their pids, and only those.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from gateway.processes import answers_ok, stop_processes
from gateway.settings import BackendEntry, Settings

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
READY_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05


def mock_command(settings: Settings, backend: BackendEntry, *, time_scale: float) -> list[str]:
    """The ``mock-vllm`` command line that impersonates ``backend``."""
    model = settings.models[backend.model].profile if backend.model in settings.models else backend.model
    parts = urlsplit(backend.url)
    cmd = [sys.executable, "-m", "gateway", "mock-vllm", "--model", model, "--hardware", backend.hardware,
           "--host", parts.hostname or "127.0.0.1", "--port", str(parts.port),
           "--tensor-parallel", str(backend.tensor_parallel), "--host-tier-gb", str(backend.host_tier_gb),
           "--time-scale", str(time_scale), "--served-model-name", backend.model, "--log-level", "warning"]
    if backend.power_cap_w is not None:
        cmd += ["--power-cap-w", str(backend.power_cap_w)]
    if backend.num_gpu_blocks_override is not None:
        cmd += ["--num-gpu-blocks-override", str(backend.num_gpu_blocks_override)]
    return cmd


def local_backends(settings: Settings) -> list[BackendEntry]:
    return [b for b in settings.backends if urlsplit(b.url).hostname in LOCAL_HOSTS]


@contextmanager
def mock_fleet(settings: Settings, *, time_scale: float, quiet: bool = True) -> Iterator[list[subprocess.Popen]]:
    """Start a mock for every local backend, wait until all answer /health, stop them on exit.

    Raises:
        RuntimeError: a mock exited during start-up (its port taken, a bad setting).
        TimeoutError: not all were healthy within READY_TIMEOUT_S.
    """
    out = subprocess.DEVNULL if quiet else None
    procs: list[subprocess.Popen] = []
    try:
        for backend in local_backends(settings):
            procs.append(subprocess.Popen(mock_command(settings, backend, time_scale=time_scale), stdout=out, stderr=out))
        pending = {b.url: p for b, p in zip(local_backends(settings), procs, strict=True)}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending:
            for url, proc in list(pending.items()):
                if proc.poll() is not None:
                    raise RuntimeError(f"mock backend for {url} exited with {proc.returncode} (is the port free?)")
                if answers_ok(f"{url}/health"):
                    del pending[url]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"mock backends not healthy after {READY_TIMEOUT_S:g}s: {sorted(pending)}")
            time.sleep(POLL_INTERVAL_S)  # poll interval between health checks
        yield procs
    finally:
        stop_processes(procs)
