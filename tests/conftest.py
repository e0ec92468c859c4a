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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_cluster import RedisCluster, missing_binaries, redis_cluster
from tests.support.redis_server import redis_server

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


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
def shared_data() -> Path:
    """``../shared/data`` beside the repo; tests that need it skip where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real traces not found at {SHARED_DATA} (they live in ../shared/data, beside the repo)")
    return SHARED_DATA
