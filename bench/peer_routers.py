"""The peer routers `bench/overhead.py` measures beside the gateway (issue 14), each installed
from PyPI into its own virtual environment and started in front of the same upstream ports.

Targets (name: package, pinned version, policy):

- ``sglang-cache``: sglang-router 0.3.2, ``--policy cache_aware`` (its default: an approximate
  radix tree of the request text per worker, load balancing past a load gap);
- ``sglang-rr``: sglang-router 0.3.2, ``--policy round_robin`` (its relay alone);
- ``vllm-router``: vllm-router 0.1.17, ``--policy cache_aware`` (its default too).

P/D targets (`PD_PEER_ROUTERS`, `bench/routing_live.py --pd`): ``vllm-router-pd`` (vllm-router
0.1.17 ``--vllm-pd-disaggregation``) and ``sglang-router-pd`` (sglang-router 0.3.2
``--pd-disaggregation``, which does not speak vLLM's protocol: see `PdPeerRouter`).

Both are Rust (axum + reqwest) inside a PyO3 extension: ``python -m <package>.launch_router``
runs the router in that Python process, which renames itself ``sglang::router`` or
``vllm::router`` and starts no child process (checked on these versions), so the CPU of the
started pid (all its threads) is the router's. The command lines, from each ``--help``:
listen on 127.0.0.1 on a free port; the Prometheus exporter (on by default at port 29000 in
both, sglang's on 0.0.0.0) on a free loopback port; log level ``warn``/``warning`` (at
``info`` both log each request, the gateway under test runs at ``warning``); everything else
as shipped: retries, circuit breaker, health checks every 60 s, no rate limit. They parse
each body and send upstream a re-serialised one (``stream`` after the messages, which
`bench/upstream_stub.py` handles). The stub does not answer SGLang's ``/get_model_info`` and
``/get_server_info``, as vLLM does not: sglang-router then registers the workers for model
``unknown`` and routes every model to them (with a model path it would fetch a tokenizer).

Ready when ``GET /readiness`` answers 200 with every worker healthy (sglang-router's
``/health`` answers 200 before it has registered any worker).

Virtual environments live in ``$KAPPA_BENCH_VENVS`` or
``${XDG_CACHE_HOME:-~/.cache}/kappa-gateway/bench-venvs/<package>-<version>/``: ``python -m
venv`` with the bench's interpreter, then ``pip install <package>==<version>``, under a file
lock; a marker written last makes a half-built environment be rebuilt, never reused. Where
that fails (no network, no wheel for the platform), the package's targets are skipped with
one line on stderr and the rest of the bench runs. It imports none of the project's packages.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

VENVS_ENV = "KAPPA_BENCH_VENVS"
INSTALLED_MARKER = ".kappa-bench-installed"  # written after pip succeeded: the venv is complete
INSTALL_TIMEOUT_S = 900.0  # venv + pip of a ~30 MB wheel and its 20-odd dependencies, on a slow mirror


@dataclass(frozen=True)
class PeerRouter:
    """One peer target: a router package at a pinned version, run with one policy."""

    target: str  # the bench's target name
    package: str  # PyPI name
    version: str  # pinned: the figures are this version's
    module: str  # ``python -m`` entry point
    policy: str  # ``--policy`` value
    log_level: str  # the quietest level that still logs errors, in the router's own spelling

    def command(self, python: Path, worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
        """The command line starting this router on 127.0.0.1:``port`` in front of ``worker_urls``."""
        return [str(python), "-m", self.module, "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *worker_urls, "--policy", self.policy, "--log-level", self.log_level,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


PEER_ROUTERS = {p.target: p for p in (
    PeerRouter("sglang-cache", "sglang-router", "0.3.2", "sglang_router.launch_router", "cache_aware", "warn"),
    PeerRouter("sglang-rr", "sglang-router", "0.3.2", "sglang_router.launch_router", "round_robin", "warn"),
    PeerRouter("vllm-router", "vllm-router", "0.1.17", "vllm_router.launch_router", "cache_aware", "warning"),
)}
READINESS_PATH = "/readiness"


@dataclass(frozen=True)
class PdPeerRouter:
    """One peer target in its P/D mode (issue 26): prefill workers and decode workers listed apart.

    What each P/D mode sends, captured on the wire by `bench/pd_capture.py` (BENCHMARKS.md, "P/D
    peers, live"): vllm-router's ``--vllm-pd-disaggregation`` (its default ``--kv-connector nixl``)
    is vLLM's NixlConnector flow, the mocks' protocol; sglang-router's ``--pd-disaggregation`` sends
    the whole request to a prefill and a decode worker at once with SGLang's ``bootstrap_host``/
    ``bootstrap_port``/``bootstrap_room``, which vLLM engines (and the mocks) ignore, so each of the
    two serves it in full (``drives_vllm_pd`` False: its figures are not P/D's).
    """

    target: str
    package: str
    version: str
    module: str
    pd_flag: str  # the flag turning the P/D mode on
    policy: str  # ``--policy``: both prefill and decode inherit it
    log_level: str
    drives_vllm_pd: bool  # whether its P/D mode speaks vLLM's (NixlConnector) protocol

    def command(self, python: Path, prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int,
                metrics_port: int) -> list[str]:
        """The command line in front of ``prefill_urls`` and ``decode_urls`` (no bootstrap ports:
        vLLM engines run no SGLang bootstrap server)."""
        cmd = [str(python), "-m", self.module, "--host", "127.0.0.1", "--port", str(port), self.pd_flag]
        for url in prefill_urls:
            cmd += ["--prefill", url]
        for url in decode_urls:
            cmd += ["--decode", url]
        return cmd + ["--policy", self.policy, "--log-level", self.log_level,
                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


PD_PEER_ROUTERS = {p.target: p for p in (
    PdPeerRouter("vllm-router-pd", "vllm-router", "0.1.17", "vllm_router.launch_router", "--vllm-pd-disaggregation",
                 "cache_aware", "warning", True),
    PdPeerRouter("sglang-router-pd", "sglang-router", "0.3.2", "sglang_router.launch_router", "--pd-disaggregation",
                 "cache_aware", "warn", False),
)}


class PeerUnavailable(Exception):
    """A peer router's package could not be installed; the message says why."""


def venvs_root(env: dict[str, str] | None = None) -> Path:
    """Where the peers' virtual environments are kept (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get(VENVS_ENV):
        return Path(env[VENVS_ENV])
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "kappa-gateway" / "bench-venvs"


def venv_python(root: Path, package: str, version: str) -> Path | None:
    """The interpreter of the complete venv for ``package==version`` under ``root``, or None."""
    venv = root / f"{package}-{version}"
    return venv / "bin" / "python" if (venv / INSTALLED_MARKER).is_file() else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:  # noqa: SIM117 -- the lock lives as long as the file is open
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(step: str, cmd: list[str], timeout_s: float) -> None:
    """Run one install step; a failure becomes `PeerUnavailable` with pip's last error line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailable(f"{step}: {exc}") from exc
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "ERROR" in line] or lines
        raise PeerUnavailable(f"{step} exited {done.returncode}: {errors[-1] if errors else 'no output'}")


def ensure_venv(package: str, version: str, root: Path, *, base_python: str = sys.executable,
                pip_options: Sequence[str] = (), timeout_s: float = INSTALL_TIMEOUT_S) -> Path:
    """The interpreter of a venv holding ``package==version``, built under ``root`` if absent.

    Args:
        package, version: the PyPI distribution and its exact version.
        root: the directory of all the bench's venvs (`venvs_root`).
        base_python: the interpreter the venv is made from (the bench's own).
        pip_options: extra ``pip install`` options (an index, ``--no-index``...).
        timeout_s: limit for each of the two steps, in seconds.

    Returns: the path of the venv's ``bin/python``.

    Raises:
        PeerUnavailable: ``venv`` or ``pip install`` failed or timed out; the half-built
            venv is removed.
    """
    with _locked(root / f"{package}-{version}.lock"):
        if (python := venv_python(root, package, version)) is not None:
            return python
        venv = root / f"{package}-{version}"
        shutil.rmtree(venv, ignore_errors=True)  # a build that died before its marker
        try:
            _run("python -m venv", [base_python, "-m", "venv", str(venv)], timeout_s)
            _run("pip install", [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                                 "--disable-pip-version-check", f"{package}=={version}", *pip_options], timeout_s)
        except PeerUnavailable:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        (venv / INSTALLED_MARKER).write_text(json.dumps({"package": package, "version": version}))
        return venv / "bin" / "python"


def install_peers(targets: Iterable[str], root: Path, *, stderr: TextIO = sys.stderr,
                  **install_options) -> tuple[dict[str, Path], dict[str, str]]:
    """Install (or find) the venvs of the peer targets among ``targets``, one per package.

    Args:
        targets: bench target names; those in neither `PEER_ROUTERS` nor `PD_PEER_ROUTERS` are ignored.
        root: as for `ensure_venv`; ``install_options`` are passed to it.
        stderr: where each package that cannot be installed gets one line.

    Returns: (target -> venv interpreter, for the installed ones; target -> why it is skipped).
    """
    known = {**PEER_ROUTERS, **PD_PEER_ROUTERS}
    peers = [known[t] for t in targets if t in known]
    pythons: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for package, version in dict.fromkeys((p.package, p.version) for p in peers):
        names = [p.target for p in peers if (p.package, p.version) == (package, version)]
        try:
            python = ensure_venv(package, version, root, **install_options)
        except PeerUnavailable as exc:
            print(f"overhead: skipping {', '.join(names)}: {package}=={version} could not be installed "
                  f"into {root}: {exc}", file=stderr, flush=True)
            skipped.update(dict.fromkeys(names, str(exc)))
            continue
        pythons.update(dict.fromkeys(names, python))
    return pythons, skipped


def is_ready(status: int, body: bytes, n_workers: int) -> bool:
    """Whether a ``GET /readiness`` answer says all ``n_workers`` workers are registered and healthy."""
    if status != 200:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("healthy_workers") == n_workers


def is_pd_ready(status: int, body: bytes, n_prefill: int, n_decode: int) -> bool:
    """Whether a P/D-mode ``GET /readiness`` answer says every prefill and decode worker is healthy:
    vllm-router's ``{"status": "ready", "prefill": {"healthy": N, ...}, "decode": {...}}``, or the
    aggregated shape (`is_ready`) with all ``n_prefill + n_decode`` workers."""
    if status != 200:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    if isinstance(doc, dict) and isinstance(doc.get("prefill"), dict) and isinstance(doc.get("decode"), dict):
        return doc["prefill"].get("healthy") == n_prefill and doc["decode"].get("healthy") == n_decode
    return is_ready(status, body, n_prefill + n_decode)
