"""Starting real gateways and backends on 127.0.0.1 for the integration tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import redis
import redis.asyncio
from redis.asyncio.connection import Connection
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.serving.server import uvicorn_options
from fleet_config.catalog import default_catalog
from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port
from dispatch import Target
from gateway.replicas.peer_load import PeerLoad
from router.cost import BackendSpec
from fleet_config.settings import parse_settings
from mock_vllm.app_factory import build_backend_app, standalone_settings
from tests.support.fake_upstream import Script, make_app
from tests.support.uvicorn_thread import serve_in_thread

MOCK_MODEL = "llama-3.1-8b"
POLL_TIMEOUT_S = 10.0
ENGINE_LIMITS = ("max_num_seqs", "max_num_batched_tokens")  # run_mocks keywords that are vLLM flags, not config fields
POLL_INTERVAL_S = 0.01


def poll(condition: Callable[[], Any], what: str, timeout_s: float = POLL_TIMEOUT_S) -> Any:
    """Poll ``condition`` until truthy; returns its value. Raises AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_INTERVAL_S)  # poll interval


@dataclass
class Gateway:
    url: str
    app: FastAPI
    http: httpx.Client

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        total = 0.0
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


def backend_doc(bid: str, url: str, hardware: str = "h100-sxm", model: str = MOCK_MODEL, **extra: Any) -> dict:
    return {"id": bid, "url": url, "model": model, "hardware": hardware, **extra}


@contextmanager
def run_gateway(backends: list[dict], *, clock: Callable[[], float] | None = None,
                **sections: dict) -> Iterator[Gateway]:
    """A real uvicorn gateway over ``backends``; fast health checks and scrapes for tests.
    ``clock`` replaces its monotonic clock (TTFT, ITL, E2E and decision timing)."""
    gateway = {"health_interval_s": 0.05, "scrape_interval_s": 0.05, **sections.pop("gateway", {})}
    doc = {"gateway": gateway, "backends": backends, **sections}
    settings = parse_settings(doc, default_catalog(), env={})
    app = create_app(settings, registry=CollectorRegistry(), **({"clock": clock} if clock is not None else {}))
    # As `gateway.serving.server.GatewayServer` serves it: the edge protocol, the real peer address.
    with serve_in_thread(app, **uvicorn_options(settings)) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield Gateway(url, app, http)


@contextmanager
def run_mocks(n: int, *, time_scale: float = 0.001, host_tier_gb: float = 16.0, **engine: Any) -> Iterator[list[str]]:
    """``n`` mock vLLM backends (llama-3.1-8b on H100), each on its own loopback port; ``engine``
    holds further backend fields (``num_gpu_blocks_override``, ...) or vLLM's batching flags."""
    catalog = default_catalog()
    settings, entry = standalone_settings(MOCK_MODEL, "h100-sxm", catalog, host_tier_gb=host_tier_gb,
                                          **{k: v for k, v in engine.items() if k not in ENGINE_LIMITS})
    limits = {k: v for k, v in engine.items() if k in ENGINE_LIMITS}
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(build_backend_app(
            settings, entry, catalog, time_scale=time_scale, registry=CollectorRegistry(), **limits)))
            for _ in range(n)]
        yield urls


# A fake's scripted hang never ends on its own: at teardown uvicorn cancels it after this long
# (its default here, 2 s, was most of the hung-upstream tests' run time).
FAKE_GRACEFUL_SHUTDOWN_S = 0.05


@contextmanager
def run_fakes(scripts: list[Script]) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_in_thread(make_app(s), graceful_shutdown_s=FAKE_GRACEFUL_SHUTDOWN_S))
               for s in scripts]


@contextmanager
def run_pooled_mocks(hardware: list[str], kv_pool: dict, *, time_scale: float = 0.01) -> Iterator[list[str]]:
    """One mock per ``hardware`` entry (llama-3.1-8b), all sharing one KV pool: `mock_fleet`'s
    single child process on free loopback ports, as ``kappa-gateway mock-fleet`` runs it."""
    backends = [backend_doc(f"m{i}", f"http://127.0.0.1:{free_port()}", hw) for i, hw in enumerate(hardware)]
    settings = parse_settings({"backends": backends, "kv_pool": kv_pool}, default_catalog(), env={})
    with mock_fleet(settings, time_scale=time_scale):
        yield [b["url"] for b in backends]


@contextmanager
def redis_index(url: str, key_prefix: str, timeout_s: float = 1.0) -> Iterator[dict]:
    """An ``index`` config section on the Redis at ``url``; its keys are deleted afterwards."""
    try:
        yield {"backend": "redis", "redis_url": url, "key_prefix": key_prefix, "timeout_s": timeout_s}
    finally:
        with redis.Redis.from_url(url) as client:
            keys = list(client.scan_iter(match=f"{key_prefix}:*"))
            if keys:
                client.delete(*keys)


async def replicas_met(a: PeerLoad, b: PeerLoad) -> None:
    """Two `PeerLoad`s know each other (B's first exchange saw A; A's next one sees B)."""
    deadline = time.monotonic() + 10
    while a.replicas_seen != 2 or b.replicas_seen != 2:
        assert time.monotonic() < deadline, "the replicas did not meet"
        await a.sync()
        await b.sync()


@asynccontextmanager
async def peer_replica(url: str, key_prefix: str, spec: BackendSpec, backends: tuple[str, ...], *,
                       connection_class: type[Connection] = Connection, **peer_options: Any) -> AsyncIterator[PeerLoad]:
    """A started `PeerLoad` of ``backends`` on the Redis at ``url`` (its own client, 1 s socket timeouts),
    stopped and closed on the way out; ``peer_options`` go to `PeerLoad`."""
    pool = redis.asyncio.ConnectionPool.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                                 connection_class=connection_class)
    client = redis.asyncio.Redis(connection_pool=pool)
    peers = PeerLoad(client, key_prefix, [Target(b, spec) for b in backends], **peer_options)
    peers.start()
    try:
        yield peers
    finally:
        await peers.stop()
        await client.aclose()
        await pool.aclose()
