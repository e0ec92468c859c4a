"""Start a throw-away ``redis-server`` on a free loopback port for the test session.

Imports none of the project's packages (STYLE.md B2). Readiness is polled with PING,
never slept for.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

READY_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.01


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server() -> Iterator[str]:
    """Run ``redis-server`` without persistence; yield its ``redis://`` URL.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH (``.ci/run`` installs it).
        TimeoutError: the server did not answer PING within READY_TIMEOUT_S.
    """
    with redis_process() as (url, _):
        yield url


@contextmanager
def frozen(proc: subprocess.Popen) -> Iterator[None]:
    """SIGSTOP ``proc`` (a server this test started) for the block; SIGCONT it on the way out,
    whatever happens."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@contextmanager
def redis_process(port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """As `redis_server`, also yielding the process (to SIGSTOP it, with `frozen`); on ``port`` when
    given (a new server where a killed one listened), else on a free one.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH (``.ci/run`` installs it).
        TimeoutError: the server did not answer PING within READY_TIMEOUT_S.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    port = free_port() if port is None else port
    with tempfile.TemporaryDirectory(prefix="kappa-redis-") as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _ping(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError("redis-server did not answer PING")
                time.sleep(POLL_INTERVAL_S)  # poll interval, not a readiness guess
            yield f"redis://127.0.0.1:{port}/0", proc
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a server this test started, by its pid: SIGCONT (a stopped server cannot act on
    SIGTERM), SIGTERM, and SIGKILL if it has not exited within 5 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
