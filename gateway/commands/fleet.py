"""Starting the mock backends a config file names, as child processes (``kappa-gateway mock-fleet``).

Each backend whose URL is on this machine is served by a ``kappa-gateway mock-fleet-worker``
process (`gateway.commands.fleet_worker`) built from that backend's own config entry, so a
mock honours every field the gateway reads. Without a ``kv_pool`` section each backend gets
its own process; with one, one process serves them all, so that they share one
`mock_vllm.kv_cache.SharedKVPool` object. The workers read the settings from a temporary
YAML file, removed when the fleet stops; a model's ``tokenizer`` directory is written there as
an absolute path, resolved against the original config's directory. Readiness is polled on each ``/health``; the
processes are ended by their pids, and only those.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from fleet_config import BackendEntry, Settings
from fleet_config.kv_events import resolve_tokenizer_dir
from gateway.commands.processes import answers_ok, stop_processes

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Seconds a child process started here (a mock fleet's, the demo's gateway) has to answer its
# health check: its Python start-up and imports take about 1 s on an idle 2-core machine and a
# few on a loaded one, so 30 s is an order of magnitude over what it needs. Shared by demo and bench.
READY_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05


def worker_command(config: Path, backends: Sequence[BackendEntry], *, time_scale: float,
                   flags: Sequence[str] = ()) -> list[str]:
    """The hidden ``mock-fleet-worker`` command line serving ``backends`` of ``config`` (``flags``:
    further worker options, e.g. the P/D ones)."""
    ids = [arg for b in backends for arg in ("--backend", b.id)]
    return [sys.executable, "-m", "gateway", "mock-fleet-worker", "--config", str(config),
            "--time-scale", str(time_scale), *flags, *ids]


def local_backends(settings: Settings) -> list[BackendEntry]:
    return [b for b in settings.backends if urlsplit(b.url).hostname in LOCAL_HOSTS]


def worker_settings_doc(settings: Settings, config_dir: Path | None) -> dict:
    """``settings`` as the workers' YAML document, each ``models.<m>.tokenizer`` made absolute
    (`fleet_config.kv_events.resolve_tokenizer_dir`: ``config_dir`` first, then the working directory).

    Raises:
        ValueError: a named tokenizer directory holds no ``tokenizer.json``.
    """
    doc = settings.model_dump(mode="json")
    for name, model in doc.get("models", {}).items():
        if model.get("tokenizer"):
            try:
                model["tokenizer"] = str(resolve_tokenizer_dir(model["tokenizer"], config_dir))
            except ValueError as exc:
                raise ValueError(f"models.{name}.tokenizer: {exc}") from exc
    return doc


@dataclass(frozen=True)
class MockProcess:
    """A child process and the local backends it serves: one, or all of them on a shared KV pool."""

    proc: subprocess.Popen
    backends: tuple[BackendEntry, ...]


def _wait_healthy(mocks: Sequence[MockProcess]) -> None:
    pending = {b.url: m for m in mocks for b in m.backends}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while pending:
        for url, mock in list(pending.items()):
            if mock.proc.poll() is not None:
                urls = ", ".join(b.url for b in mock.backends)
                raise RuntimeError(f"mock backend for {urls} exited with {mock.proc.returncode} (is the port free?)")
            if answers_ok(f"{url}/health"):
                del pending[url]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"mock backends not healthy after {READY_TIMEOUT_S:g}s: {sorted(pending)}")
        time.sleep(POLL_INTERVAL_S)  # poll interval between health checks


@contextmanager
def mock_fleet(settings: Settings, *, time_scale: float, quiet: bool = True, worker_flags: Sequence[str] = (),
               config_dir: Path | None = None) -> Iterator[list[MockProcess]]:
    """Start the mocks of every local backend, wait until all answer /health, stop them on exit.

    Without ``kv_pool``: one process per backend. With it: one process serving them all. Each
    mock takes its backend's ``kv_role`` and the config's ``interconnect`` from the config;
    ``worker_flags`` go to every worker (``--kv-load-failure-policy``, ...). ``config_dir``: the
    directory of the file ``settings`` came from, where relative tokenizer paths start.

    Raises:
        ValueError: a model's tokenizer directory is missing (`worker_settings_doc`).
        RuntimeError: a mock exited during start-up (its port taken, a bad setting).
        TimeoutError: not all were healthy within READY_TIMEOUT_S.
    """
    out = subprocess.DEVNULL if quiet else None
    backends = local_backends(settings)
    groups = [backends] if settings.kv_pool is not None else [[b] for b in backends]
    mocks: list[MockProcess] = []
    doc = worker_settings_doc(settings, config_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="mock-fleet-", delete=False) as f:
        yaml.safe_dump(doc, f)
    config = Path(f.name)
    try:
        for group in groups:
            if group:
                proc = subprocess.Popen(worker_command(config, group, time_scale=time_scale, flags=worker_flags),
                                        stdout=out, stderr=out)
                mocks.append(MockProcess(proc, tuple(group)))
        _wait_healthy(mocks)
        yield mocks
    finally:
        stop_processes([m.proc for m in mocks])
        config.unlink(missing_ok=True)
