"""The processes of `bench/faults.py`: Redis, the mock backends, the probe's stub and the gateway as children.

Only processes started here are ever signalled, by their pid. Imports none of the
project's packages (the bench drives them through ``python -m gateway`` and HTTP), so it
runs against any revision of the tree (``--tree``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import yaml

POLL_S = 0.05  # readiness polling period
START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_setup() -> None:
    """In the child before exec: SIGKILL it if the bench dies without its finally (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the bench's finally is the only guard


class Children:
    """The processes the bench owns, by name. Only these are ever signalled, by their pid."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()
        self._logs: list = []

    def start(self, name: str, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} (pid {old.pid}) is still running")
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 -- closed in end_all
        self._logs.append(log)
        # Own session: a Ctrl-C in the terminal reaches the bench only, which then ends these by pid.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=True, preexec_fn=_child_setup)
        self.procs[name] = proc
        return proc

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} (pid {proc.pid}) exited early with {proc.returncode}")
        os.kill(proc.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(name)
        elif sig == signal.SIGCONT:
            self.stopped.discard(name)
        elif sig == signal.SIGKILL:
            proc.wait()

    def log_tail(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def end_all(self, timeout_s: float = 8.0) -> None:
        """SIGCONT what we stopped, SIGTERM everything still running, SIGKILL what outlives ``timeout_s``."""
        for name in list(self.stopped):
            proc = self.procs[name]
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            self.stopped.discard(name)
        alive = [p for p in self.procs.values() if p.poll() is None]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in alive:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float,
                     alive: Callable[[], bool], tail: Callable[[], str]) -> None:
    """Poll ``await check()`` every POLL_S until it is true; fail at ``timeout_s`` or if not ``alive()``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what}: the process exited\n{tail()}")
        try:
            if await check():
                return
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError):
            pass
        await asyncio.sleep(POLL_S)  # polling: the check above is the readiness signal
    raise TimeoutError(f"{what}: not ready within {timeout_s:g}s\n{tail()}")


async def redis_pings(port: int) -> bool:
    """True if a redis-server on 127.0.0.1:``port`` answers PING (raises OSError/TimeoutError if not)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    try:
        writer.write(b"PING\r\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG")
    finally:
        writer.close()


class Fleet:
    """Redis, the mocks, the probe's stub and the gateway, as children of this process; HTTP probes on them."""

    def __init__(self, workdir: Path, tree: Path, make_config: Callable[[int, list[int], str, int], dict], *,
                 n_backends: int, mock_args: list[str] | Callable[[str], list[str]]) -> None:
        """``make_config(gateway_port, backend_ports, redis_url, stub_port)`` gives the gateway's
        config (the stub is one more backend, `faults_probe`'s), written to `config_path` before
        any child starts; ``mock_args`` are the options of every ``python -m gateway mock-vllm``
        but its port, or backend name → its options (a mock started from that config: P/D)."""
        self.workdir, self.tree, self.mock_args, self.n_backends = workdir, tree, mock_args, n_backends
        self.children = Children(workdir)
        self.redis_port, self.gateway_port, self.stub_port = free_port(), free_port(), free_port()
        self.backend_ports = [free_port() for _ in range(n_backends)]
        self.config = make_config(self.gateway_port, self.backend_ports, f"redis://127.0.0.1:{self.redis_port}/0",
                                  self.stub_port)
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.config_path = workdir / "gateway.yaml"
        self.http: aiohttp.ClientSession | None = None

    def start_redis(self) -> None:
        self.children.start("redis", [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(self.workdir)], self.tree)

    def start_backend(self, name: str) -> None:
        port = self.backend_ports[int(name[1:])]
        args = self.mock_args(name) if callable(self.mock_args) else self.mock_args
        self.children.start(name, [sys.executable, "-m", "gateway", "mock-vllm", *args, "--port", str(port)],
                            self.tree)

    def backend_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.backend_ports[int(name[1:])]}"

    async def start(self) -> None:
        """Redis first (the gateway connects at start-up), then the mocks and the gateway; poll until ready."""
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.start_redis()
        await self.wait_process("redis", lambda: redis_pings(self.redis_port))
        for i in range(self.n_backends):
            self.start_backend(f"b{i}")
        # The mocks bind their ports before the gateway starts connecting out: a client socket's
        # ephemeral source port could otherwise take a port chosen for a mock (free_port's race).
        for i in range(self.n_backends):
            url = f"http://127.0.0.1:{self.backend_ports[i]}/health"
            await self.wait_process(f"b{i}", lambda url=url: self.get_ok(url))
        # The probe's upstream, always from this bench's tree (it is the bench's, not the gateway's).
        bench = Path(__file__).resolve().parent
        self.children.start("stub", [sys.executable, str(bench / "upstream_stub.py"), "--port", str(self.stub_port)],
                            bench.parent, env={**os.environ, "PYTHONPATH": str(bench.parent)})
        await self.wait_process("stub", lambda: self.get_ok(f"http://127.0.0.1:{self.stub_port}/health"))
        self.children.start("gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path),
                                        "--log-level", "warning"], self.tree)
        await self.wait_process("gateway", lambda: self.get_ok(self.url + "/ready"))
        await self.wait_whole()

    async def wait_process(self, name: str, check: Callable[[], Awaitable[bool]],
                           timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``check`` until true; fail, with the log's tail, if process ``name`` exits or the time runs out."""
        proc = self.children.procs[name]
        await wait_until(check, name, timeout_s, alive=lambda: proc.poll() is None,
                         tail=lambda: self.children.log_tail(name))

    async def get_ok(self, url: str) -> bool:
        async with self.http.get(url) as resp:
            return resp.status == 200

    async def wait_whole(self) -> None:
        """Until Redis answers and the gateway reports every configured backend (the probe's stub, when
        the config lists it) healthy."""
        async def whole() -> bool:
            if not await redis_pings(self.redis_port):
                return False
            async with self.http.get(self.url + "/v1/kappa/backends") as resp:
                return sum(b["healthy"] for b in (await resp.json())["backends"]) == len(self.config["backends"])
        await self.wait_process("gateway", whole)

    async def counters(self) -> dict[str, float] | None:
        """Sums of the gateway's index-error, retry and P/D split and prefill-fallback counters; None if
        it does not answer."""
        out = {"index_errors": 0.0, "retries": 0.0, "splits": 0.0, "prefill_fallbacks": 0.0}
        names = {"gateway_index_errors_total": "index_errors", "gateway_upstream_retries_total": "retries",
                 "gateway_pd_splits_total": "splits", "gateway_pd_prefill_fallbacks_total": "prefill_fallbacks"}
        try:
            async with self.http.get(self.url + "/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                out[names[name]] += float(line.rsplit(" ", 1)[1])
        return out
