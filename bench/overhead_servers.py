"""The servers `bench/overhead.py` loads, each its own process on 127.0.0.1: the upstream
stub, the bare proxy, ``redis-server``, the gateways and the peer routers.

`servers` starts them all and waits for each to answer its readiness endpoint (polling it,
not sleeping in its place); `Processes` ends them by pid, in reverse order of start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peer_routers import PEER_ROUTERS, READINESS_PATH, is_ready

import hot_path
from fleet_config.catalog import default_catalog
from fleet_config.settings import parse_settings
from gateway.commands.fleet import READY_TIMEOUT_S
from gateway.commands.processes import free_port, stop_processes

BENCH_DIR = Path(__file__).resolve().parent
# The fleet every gateway target routes over: the stub's listeners, as this model on this GPU.
MODEL, HARDWARE, N_BACKENDS = "llama-3.1-8b", "h100-sxm", 8


class Processes:
    """Every process the bench starts; `stop` ends them by pid, in reverse."""

    def __init__(self, logdir: Path) -> None:
        self.logdir, self.procs = logdir, []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              stdout_pipe: bool = False, cwd: Path = BENCH_DIR.parent) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 -- open while the process runs
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if stdout_pipe else log, stderr=log,
                                env={**os.environ, **(env or {})}, cwd=cwd)
        self.procs.append((name, proc, log))
        return proc

    def stop(self) -> None:
        stop_processes(proc for _, proc, _ in reversed(self.procs))
        for _, proc, log in reversed(self.procs):
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()

    def log_tail(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")[-2000:]


def json_line(proc: subprocess.Popen) -> dict:
    """The JSON object a started process prints first on stdout (its port or ports)."""
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"process {proc.pid} exited before reporting its port")
    return json.loads(line)


def http_get(port: int, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """GET ``path`` on 127.0.0.1:``port``: (status, body), an HTTP error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _answers_ready(path: str, status: int, body: bytes) -> bool:
    if path == "/ready":  # the gateway's: every backend healthy
        return status == 200 and json.loads(body)["healthy_backends"] == N_BACKENDS
    if path == READINESS_PATH:  # a peer router's: every worker registered and healthy
        return is_ready(status, body, N_BACKENDS)
    return status == 200


def wait_ready(port: int, path: str, procs: Processes, name: str) -> None:
    """Poll until ``path`` answers 200 (for the gateway, /ready with all 8 backends healthy;
    for a peer router, /readiness with all 8 workers healthy)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            status, body = http_get(port, path)
            if _answers_ready(path, status, body):
                return
        time.sleep(0.05)  # polling a readiness endpoint, not sleeping in place of it
    raise TimeoutError(f"{name} not ready on port {port} within {READY_TIMEOUT_S}s:\n{procs.log_tail(name)}")


def gateway_config(stub_ports: list[int], port: int, redis_url: str | None, key_prefix: str) -> dict:
    """A gateway config over the stub's ports (the memory index, or Redis at ``redis_url``), validated."""
    index: dict[str, Any] = {"backend": "memory"}
    if redis_url:
        index.update(backend="redis", redis_url=redis_url, key_prefix=key_prefix)
    doc = {"gateway": {"host": "127.0.0.1", "port": port, "health_interval_s": 2.0, "scrape_interval_s": 1.0,
                       "shutdown_drain_delay_s": 0.0},
           "index": index, "routing": {"policy": "kappa", "seed": 0},
           "backends": [{"id": f"b{i}", "url": f"http://127.0.0.1:{p}", "model": MODEL, "hardware": HARDWARE}
                        for i, p in enumerate(stub_ports)]}
    parse_settings(doc, default_catalog(), env={})  # fail here, with the path, on a bad config
    return doc


@contextlib.contextmanager
def servers(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[dict[str, tuple[int, int]], dict[str, int]]]:
    """Start the stub, the bare proxy, Redis, the gateways and the installed peer routers
    (``args.peer_pythons``: target -> venv interpreter); yield target name -> (port, pid), and
    the pids of the processes every target uses (``redis-server``, ``stub``)."""
    procs = Processes(workdir)
    py = sys.executable
    try:
        stub = procs.start("stub", [py, str(BENCH_DIR / "upstream_stub.py"), "--listeners", str(N_BACKENDS)],
                           stdout_pipe=True)
        stub_ports = json_line(stub)["ports"]
        bare = procs.start("bare", [py, str(BENCH_DIR / "bare_proxy.py"), "--upstream",
                                    f"http://127.0.0.1:{stub_ports[0]}"], stdout_pipe=True)
        targets = {"direct": stub_ports[0], "bare": json_line(bare)["port"]}
        pids = {"direct": stub.pid, "bare": bare.pid}
        if "bare-w2" in args.targets:
            bare2 = procs.start("bare-w2", [py, str(BENCH_DIR / "bare_proxy.py"), "--workers", "2", "--upstream",
                                            f"http://127.0.0.1:{stub_ports[0]}"], stdout_pipe=True)
            targets["bare-w2"], pids["bare-w2"] = json_line(bare2)["port"], bare2.pid
        redis_port = free_port()
        redis = procs.start("redis", [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)])
        gateways = _start_gateways(procs, args, workdir, stub_ports, f"redis://127.0.0.1:{redis_port}/0")
        peers = _start_peers(procs, args, stub_ports)
        for name, (port, pid) in {**gateways, **peers}.items():
            targets[name], pids[name] = port, pid
        wait_ready(stub_ports[-1], "/health", procs, "stub")
        for name in ("bare", "bare-w2"):
            if name in targets:
                wait_ready(targets[name], "/health", procs, name)
        for name in gateways:
            wait_ready(targets[name], "/ready", procs, name)
        for name in peers:
            wait_ready(targets[name], READINESS_PATH, procs, name)
        yield ({t: (p, pids[t]) for t, p in targets.items() if t in args.targets or "@" in t},
               {"redis-server": redis.pid, "stub": stub.pid})
    finally:
        procs.stop()


def _start_gateways(procs: Processes, args: argparse.Namespace, workdir: Path, stub_ports: list[int],
                    redis_url: str) -> dict[str, tuple[int, int]]:
    """Start the gateway targets ``args`` names (memory and redis always); name -> (port, pid)."""
    gateways: list[tuple[str, str | None, str | None]] = [("memory", None, None), ("redis", redis_url, None)]
    gateways += [("relay", None, None)] if "relay" in args.targets else []
    gateways += [("redis-w2", redis_url, None)] if "redis-w2" in args.targets else []
    gateways += [("redis-pure", redis_url, None)] if "redis-pure" in args.targets else []
    gateways += [("memory-pure", None, None)] if "memory-pure" in args.targets else []
    gateways += [(f"redis@{name}", redis_url, tree) for name, tree in args.compare]
    started = {}
    for name, url, tree in gateways:
        port = free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(json.dumps(gateway_config(stub_ports, port, url, "bench-" + name.replace("@", "-"))))
        # `python -m` puts its working directory first on sys.path: the tree under test wins.
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
               # -pure: the hot path from its Python sources (hot_path), the others as built
               hot_path.PURE_PYTHON_ENV: "1" if name.endswith("-pure") else ""}
        entry = [str(BENCH_DIR / "relay_only.py")] if name == "relay" else ["-m", "gateway"]
        workers = ["--workers", "2"] if name.endswith("-w2") else []
        gateway = procs.start(name, [sys.executable, *entry, "serve", "--config", str(config), "--log-level",
                                     "warning", *workers], env, cwd=Path(tree) if tree else BENCH_DIR.parent)
        started[name] = (port, gateway.pid)
    return started


def _start_peers(procs: Processes, args: argparse.Namespace, stub_ports: list[int]) -> dict[str, tuple[int, int]]:
    """Start the installed peer routers (``args.peer_pythons``) in front of the stub's ports,
    recording each command line in ``args.peer_commands``; name -> (port, pid)."""
    worker_urls = [f"http://127.0.0.1:{p}" for p in stub_ports]
    started = {}
    for name, python in args.peer_pythons.items():
        port = free_port()
        cmd = PEER_ROUTERS[name].command(python, worker_urls, port, metrics_port=free_port())
        args.peer_commands[name] = shlex.join(cmd)
        started[name] = (port, procs.start(name, cmd).pid)
    return started
