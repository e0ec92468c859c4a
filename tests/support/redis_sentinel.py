"""Start a throw-away Redis master, a replica of it and a Sentinel monitoring them, on loopback.

`SentinelSetup.kill_master` crashes the master and waits for the Sentinel's failover.

The replica is attached (and seen by the master) before the Sentinel starts, so the
Sentinel's first INFO of the master already lists it and a failover can be asked for at
once (Sentinel otherwise learns of replicas from an INFO every 10 s). Readiness is polled,
never slept for; the processes are stopped by pid on the way out.

Imports none of the project's packages (STYLE.md B2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.support.redis_server import POLL_INTERVAL_S, free_port, stop_process

READY_TIMEOUT_S = 15.0
SERVICE = "kappa-master"


# Sentinel marks a silent master down after this long (its default, 30 s, is for real networks).
DOWN_AFTER_MS = 1000


@dataclass
class SentinelSetup:
    sentinel_port: int
    procs: dict[int, subprocess.Popen]  # port -> the master's and the replica's processes

    @property
    def url(self) -> str:
        """The index's ``redis+sentinel://`` form for it."""
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}/0"

    def master_port(self) -> int:
        """The port of the master the Sentinel names now."""
        with redis.Redis(port=self.sentinel_port, decode_responses=True) as sentinel:
            _, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def kill_master(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """SIGKILL the master (a crash); return the new master's port once the Sentinel has
        failed over to the replica, names it as a master that is up, and it accepts writes."""
        old = self.master_port()
        os.kill(self.procs[old].pid, signal.SIGKILL)
        self.procs[old].wait()

        def new_master_up() -> int | None:
            with redis.Redis(port=self.sentinel_port, decode_responses=True) as sentinel:
                state = sentinel.sentinel_masters()[SERVICE]
            up = state["port"] != old and not state["is_sdown"] and not state["is_odown"]
            return int(state["port"]) if up else None

        new = _poll(new_master_up, "the Sentinel to fail over to the replica", timeout_s)
        _poll(lambda: _role(new) == "master", "the new master to take writes", timeout_s)
        return new


def _role(port: int) -> str | None:
    try:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=0.5) as client:
            return client.info("replication").get("role")
    except redis.RedisError:
        return None


def _poll(condition: Callable[[], Any], what: str, timeout_s: float = READY_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except redis.RedisError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis sentinel: timed out waiting for {what}")
        time.sleep(POLL_INTERVAL_S)  # poll interval, not a readiness guess


def _replicas_attached(port: int) -> int:
    with redis.Redis(port=port, decode_responses=True) as client:
        return int(client.info("replication")["connected_slaves"])


def _replica_ready(sentinel_port: int) -> bool:
    with redis.Redis(port=sentinel_port, decode_responses=True) as sentinel:
        replicas = sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE)
    return any("s_down" not in r["flags"] and "disconnected" not in r["flags"]
               and r.get("master-link-status") == "ok" for r in replicas)


@contextmanager
def redis_sentinel(workdir: Path) -> Iterator[SentinelSetup]:
    """A master, its replica and one Sentinel (quorum 1) under ``workdir``.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH (it runs the Sentinel too, ``--sentinel``).
        TimeoutError: a process did not come up, or the Sentinel did not see the replica, in time.
    """
    if shutil.which("redis-server") is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    with ExitStack() as stack:
        master, replica, sentinel = free_port(), free_port(), free_port()

        def start(args: list[str]) -> subprocess.Popen:
            proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(stop_process, proc)
            return proc

        procs = {}
        for i, port in enumerate((master, replica)):
            node_dir = workdir / f"node-{i}"
            node_dir.mkdir(parents=True)
            procs[port] = start(["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(node_dir), "--repl-diskless-sync-delay", "0",
                   *(["--replicaof", "127.0.0.1", str(master)] if port == replica else [])])
        _poll(lambda: _role(replica) == "slave" and _replicas_attached(master), "the replica to attach to the master")
        conf = workdir / "sentinel.conf"  # Sentinel rewrites its config file: it must be writable
        conf.write_text(f"port {sentinel}\nbind 127.0.0.1\ndir {workdir}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {master} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                        f"sentinel failover-timeout {SERVICE} 10000\n")
        start([str(conf), "--sentinel"])
        setup = SentinelSetup(sentinel, procs)
        _poll(lambda: setup.master_port() == master, "the Sentinel to answer for the master")
        _poll(lambda: _replica_ready(sentinel), "the Sentinel to see the replica")
        yield setup
