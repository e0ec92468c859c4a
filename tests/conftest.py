"""Shared fixtures: a real redis-server per session (or ``--redis-url``), a real 3-master
Redis Cluster per session (started on first use)."""

from __future__ import annotations

import hot_path

# The test run's entry point: compiled or source (KAPPA_PURE_PYTHON=1: the sources), before
# any test module imports a compiled one (hot_path.select).
hot_path.select()

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sim.real_traces import missing_message, real_trace_path
from tests.support.redis_cluster import RedisCluster, missing_binaries, redis_cluster
from tests.support.redis_server import redis_server



def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None, help="use this Redis instead of starting one")


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a real Redis: ``--redis-url`` if given, else a fresh loopback redis-server."""
    given = request.config.getoption("--redis-url")
    if given:
        yield given
        return
    if not shutil.which("redis-server") and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed (apt-get install redis-server, or pass --redis-url)")
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real Redis Cluster of 3 masters (``redis-server --cluster-enabled yes`` on loopback,
    joined by ``redis-cli --cluster create``), shared by the session; its ``url`` is the
    index's ``redis+cluster://`` form."""
    missing = missing_binaries()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install redis-server, which brings "
                    "redis-tools and redis-cli)")
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def key_prefix() -> str:
    """A unique Redis key prefix per test, so tests never see each other's keys."""
    return f"kgtest-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def real_trace() -> Callable[[str], Path]:
    """``real_trace(name)``: the path of a real trace (`sim.real_traces.REAL_TRACES`), or the test
    skips, saying where the file comes from and which generated workload stands in for it (the
    real traces are not in the repository: README, "Real traces")."""
    def path_of(name: str) -> Path:
        path = real_trace_path(name)
        if not path.is_file():
            pytest.skip(missing_message(name))
        return path

    return path_of
