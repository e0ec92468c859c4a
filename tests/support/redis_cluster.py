"""Start a throw-away Redis Cluster (N masters, no replicas) of ``redis-server`` processes on loopback.

Each node runs in its own directory with ``--cluster-enabled yes`` on a free port, its
cluster bus on another free port (``--cluster-port``, so port + 10000 need not be free);
``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes`` assigns the 16,384
slots, then every node's ``CLUSTER INFO`` is polled until it says ``cluster_state:ok``
(never slept for). The processes are stopped by pid on the way out, whatever happens.

Imports none of the project's packages (STYLE.md B2).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.support.redis_server import POLL_INTERVAL_S, free_port, stop_process

READY_TIMEOUT_S = 15.0
CREATE_TIMEOUT_S = 30.0


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class RedisCluster:
    nodes: list[ClusterNode]

    @property
    def url(self) -> str:
        """The index's URL form for it: ``redis+cluster://`` with every node as a startup node."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def node_of_key(self, key: str) -> ClusterNode:
        """The master that serves ``key``'s slot (asked of the cluster, not computed here)."""
        with redis.Redis(port=self.nodes[0].port) as client:
            slot = client.execute_command("CLUSTER KEYSLOT", key)
            for start, end, (host, port, *_), *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot}")


def missing_binaries() -> list[str]:
    """The programs this module needs that are not on PATH (Debian: redis-server, redis-tools)."""
    return [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]


def _cluster_ok(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            info = client.cluster("INFO")  # redis-py parses it into a dict of str
    except redis.RedisError:
        return False
    return info.get("cluster_state") == "ok" and str(info.get("cluster_slots_ok")) == "16384"


def _ping(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _poll(condition, what: str, nodes: list[ClusterNode], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for n in nodes:
            if n.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {n.port} exited with {n.proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis cluster: timed out waiting for {what}")
        time.sleep(POLL_INTERVAL_S)  # poll interval, not a readiness guess


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[RedisCluster]:
    """Run a ``masters``-node Redis Cluster under ``workdir``; yield it once every node says
    ``cluster_state:ok``.

    Raises:
        FileNotFoundError: ``redis-server`` or ``redis-cli`` is not on PATH.
        TimeoutError: the nodes did not start, or the cluster did not become ok, in time.
        subprocess.CalledProcessError: ``redis-cli --cluster create`` failed.
    """
    missing = missing_binaries()
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not installed (apt-get install redis-server)")
    with ExitStack() as stack:
        nodes: list[ClusterNode] = []
        for i in range(masters):
            port, bus_port = free_port(), free_port()
            node_dir = workdir / f"node-{i}"
            node_dir.mkdir(parents=True)
            proc = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                 "--cluster-config-file", str(node_dir / "nodes.conf")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            stack.callback(stop_process, proc)
            nodes.append(ClusterNode(port, bus_port, proc))
        _poll(lambda: all(_ping(n.port) for n in nodes), "the nodes to answer PING", nodes, READY_TIMEOUT_S)
        subprocess.run(["redis-cli", "--cluster", "create", *(n.address for n in nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=CREATE_TIMEOUT_S)
        _poll(lambda: all(_cluster_ok(n.port) for n in nodes), "cluster_state:ok on every node", nodes,
              READY_TIMEOUT_S)
        yield RedisCluster(nodes)
