"""The Redis index and the replicas' load exchange on a real Redis Cluster (issue 15).

A session-wide cluster of 3 ``redis-server --cluster-enabled yes`` masters on loopback,
joined by ``redis-cli --cluster create`` (``tests/support/redis_cluster.py``; the contract
suite in ``tests/contract/test_prefix_index.py`` runs on it too). Here: where the keys land
(each model's keys on one shard, models spread over the shards), stats/forget/TTL across
shards, the scripts reloaded on every shard, real gateways routing prefix matches through the
cluster with the official ``openai`` client, two gateways exchanging their load through it, and
a frozen shard opening the index's breaker while requests are still served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager

import openai
import pytest
import redis
from prometheus_client import CollectorRegistry
from redis.utils import HIREDIS_AVAILABLE

from fleet_config import default_catalog
from mock_vllm.app_factory import build_backend_app, standalone_settings
from prefix_index import TierCapacity
from prefix_index.redis_index import RedisPrefixIndex
from prefix_index.redis_connect import HiredisPacking
from tests.integration.gateway_support import (
    Gateway,
    backend_doc,
    poll,
    run_fakes,
    run_gateway,
)
from tests.support.fake_upstream import Script
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import frozen
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(60)]

ROOMY = TierCapacity(hbm_blocks=1000, host_blocks=1000)
# Catalog models whose hash tags fall on different masters of a 3-master cluster
# (redis-cli assigns slots 0-5460, 5461-10922, 10923-16383): asserted below, not assumed.
LLAMA, QWEN = "llama-3.1-8b", "qwen3-0.6b"
DOCUMENT = "Minutes of the harbour board, third quarter: berths, dredging, tariffs. " * 60


def chat(model: str, question: str) -> dict:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]}


def keys_by_node(cluster: RedisCluster, key_prefix: str) -> dict[int, set[str]]:
    """Port of each master -> the keys under ``key_prefix`` it holds (asked of each node itself)."""
    out = {}
    for node in cluster.nodes:
        with redis.Redis(port=node.port, decode_responses=True) as client:
            out[node.port] = set(client.scan_iter(match=f"{key_prefix}:*", count=1000))
    return out


@contextmanager
def cleaned(cluster: RedisCluster, key_prefix: str) -> Iterator[None]:
    try:
        yield
    finally:
        for node in cluster.nodes:
            with redis.Redis(port=node.port) as client:
                for key in client.scan_iter(match=f"{key_prefix}:*", count=1000):
                    client.unlink(key)


async def test_each_models_keys_stay_on_one_shard_and_models_spread(redis_cluster_nodes: RedisCluster,
                                                                     key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    models = ["m1", "m2", LLAMA, QWEN, "model{with}braces"]
    with cleaned(cluster, key_prefix):
        index = RedisPrefixIndex.from_url(cluster.url, key_prefix=key_prefix, timeout_s=2.0, key_ttl_s=600)
        # The peers' exchange keys are in their own slot: a model's batch cannot carry them here.
        assert index.carry(lambda: None) is False
        try:
            for i, model in enumerate(models):
                # Several models' records and matches in one loop turn: one EVALSHA per model.
                await asyncio.gather(index.record(model, "b1", [1, 2, 3, i + 10], ROOMY),
                                     index.record(model, "b2", [1, 2], ROOMY))
            matches = await asyncio.gather(*(index.match(m, [1, 2, 3, 99], {"b1": ROOMY, "b2": ROOMY})
                                             for m in models))
            assert [(r["b1"].matched_blocks, r["b2"].matched_blocks) for r in matches] == [(3, 2)] * len(models)
            stats = await index.stats()  # SCAN on every primary
            assert stats.blocks_by_backend == {"b1": 4 * len(models), "b2": 2 * len(models)}
            assert stats.memory_bytes > 0
            if HIREDIS_AVAILABLE:  # every shard's connections, found after the start, pack with hiredis
                nodes = index._client.get_nodes()
                assert len(nodes) == 3 and all(issubclass(n.connection_class, HiredisPacking) for n in nodes)
        finally:
            await index.aclose()
        held = keys_by_node(cluster, key_prefix)
        shards_of_models = []
        for model in models:
            tag = "model%7Bwith%7Dbraces" if "{" in model else model
            own = {f"{key_prefix}:{{{tag}}}:clock", f"{key_prefix}:{{{tag}}}:blocks:b1",
                   f"{key_prefix}:{{{tag}}}:blocks:b2"}
            holders = [port for port, keys in held.items() if own & keys]
            assert len(holders) == 1 and own <= held[holders[0]], (model, holders)
            shards_of_models.append(holders[0])
        assert len(set(shards_of_models)) == 3  # every master holds some model
        with redis.Redis(port=cluster.node_of_key(f"{key_prefix}:{{{LLAMA}}}:clock").port) as client:
            assert 590 <= client.ttl(f"{key_prefix}:{{{LLAMA}}}:blocks:b1") <= 600
            assert 590 <= client.ttl(f"{key_prefix}:{{{LLAMA}}}:clock") <= 600
        registry = f"{key_prefix}:backend-models:b1"
        with redis.Redis(port=cluster.node_of_key(registry).port, decode_responses=True) as client:
            assert client.smembers(registry) == set(models)
            assert 600 < client.ttl(registry) <= 750  # a quarter more than the blocks keys


async def test_forget_on_a_cluster_deletes_every_shards_keys(redis_cluster_nodes: RedisCluster,
                                                             key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    models = ["m1", "m2", "m3", LLAMA]
    with cleaned(cluster, key_prefix):
        index = RedisPrefixIndex.from_url(cluster.url, key_prefix=key_prefix, timeout_s=2.0)
        try:
            for model in models:
                await index.record(model, "gone", [7, 8, 9], ROOMY)
                await index.record(model, "kept", [7, 8], ROOMY)
            await index.forget("gone")
            for model in models:
                result = await index.match(model, [7, 8, 9], {"gone": ROOMY, "kept": ROOMY})
                assert (result["gone"].matched_blocks, result["kept"].matched_blocks) == (0, 2)
        finally:
            await index.aclose()
        left = set().union(*keys_by_node(cluster, key_prefix).values())
        assert not any(k.endswith(":blocks:gone") or k.endswith(":backend-models:gone") for k in left), left
        assert sum(k.endswith(":blocks:kept") for k in left) == len(models)


async def test_the_script_is_reloaded_on_a_shard_that_lost_it(redis_cluster_nodes: RedisCluster,
                                                              key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    with cleaned(cluster, key_prefix):
        index = RedisPrefixIndex.from_url(cluster.url, key_prefix=key_prefix, timeout_s=2.0)
        try:
            await index.record(QWEN, "b1", [1, 2], ROOMY)
            with redis.Redis(port=cluster.node_of_key(f"{key_prefix}:{{{QWEN}}}:clock").port) as client:
                client.script_flush()  # as after a restart or a failover to a fresh node
            assert (await index.match(QWEN, [1, 2], {"b1": ROOMY}))["b1"].matched_blocks == 2
        finally:
            await index.aclose()


def run_mock(model: str) -> AbstractContextManager[str]:
    """A mock vLLM backend serving ``model`` on H100 (100x faster than real time); yields its URL."""
    catalog = default_catalog()
    settings, entry = standalone_settings(model, "h100-sxm", catalog, host_tier_gb=16.0)
    return serve_in_thread(build_backend_app(settings, entry, catalog, time_scale=0.001, registry=CollectorRegistry()))


def cluster_index(cluster: RedisCluster, key_prefix: str, **extra: object) -> dict:
    return {"backend": "redis", "redis_url": cluster.url, "key_prefix": key_prefix, "timeout_s": 1.0, **extra}


def test_a_gateway_routes_prefix_matches_through_the_cluster(redis_cluster_nodes: RedisCluster,
                                                             key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    assert cluster.node_of_key(f"{key_prefix}:{{{LLAMA}}}:clock") != cluster.node_of_key(
        f"{key_prefix}:{{{QWEN}}}:clock")
    with ExitStack() as stack:
        stack.enter_context(cleaned(cluster, key_prefix))
        fleet = [backend_doc(f"{tag}{i}", stack.enter_context(run_mock(model)), model=model)
                 for tag, model in (("l", LLAMA), ("q", QWEN)) for i in range(2)]
        gw = stack.enter_context(run_gateway(fleet, index=cluster_index(cluster, key_prefix)))
        poll(lambda: all(b["healthy"] for b in gw.http.get("/v1/kappa/backends").json()["backends"]),
             "the mocks to be healthy")
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        for model in (LLAMA, QWEN):
            first = client.chat.completions.with_raw_response.create(**chat(model, "Who chaired it?"))
            assert float(first.headers["x-kappa-ratio"]) == 0
            home = first.headers["x-kappa-backend"]

            def follow_up() -> tuple[str, float] | None:
                raw = client.chat.completions.with_raw_response.create(**chat(model, "And the tariffs?"))
                ratio = float(raw.headers["x-kappa-ratio"])
                return (raw.headers["x-kappa-backend"], ratio) if ratio > 0 else None

            backend, ratio = poll(follow_up, f"a {model} follow-up to match the document's prefix")
            assert backend == home and ratio > 5  # the document is cached; only the question is new
        cached = {b["id"]: b["cached_blocks"] for b in gw.http.get("/v1/kappa/backends").json()["backends"]}
        assert all(n is not None for n in cached.values())  # stats answered from every shard
        assert sum(n > 0 for n in cached.values()) == 2  # one home per model
        assert gw.metric("gateway_index_errors_total") == 0
        held = keys_by_node(cluster, key_prefix)
        for model in (LLAMA, QWEN):
            port = cluster.node_of_key(f"{key_prefix}:{{{model}}}:clock").port
            assert any(k.startswith(f"{key_prefix}:{{{model}}}:blocks:") for k in held[port])


def test_two_gateways_exchange_their_load_through_the_cluster(redis_cluster_nodes: RedisCluster,
                                                              key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    hang = Script(mode="hang")
    edge = {"upstream_first_byte_timeout_s": 2}
    with ExitStack() as stack:
        stack.enter_context(cleaned(cluster, key_prefix))
        (url,) = stack.enter_context(run_fakes([hang]))
        index = cluster_index(cluster, key_prefix, load_sync_interval_s=0.02)
        b = stack.enter_context(run_gateway([backend_doc("x", url)], index=index, gateway=edge))
        with run_gateway([backend_doc("x", url)], index=index, gateway=edge) as a:
            poll(lambda: b.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 2,
                 "the replicas to meet through the cluster")
            a_id = a.http.get("/v1/kappa/backends").json()["peers"]["replica_id"]
            client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="unused", max_retries=0, timeout=10)
            with ThreadPoolExecutor(2) as pool:
                pending = [pool.submit(lambda: _quietly(client, chat(LLAMA, "q"))) for _ in range(2)]
                seen = poll(lambda: (x := _backend(b, "x"))["peer_in_flight"] == 2 and x, "B to see A's requests")
                assert seen["in_flight"] == 0
                for p in pending:
                    p.result()
        # A stopped cleanly: its figures are withdrawn at once, not left to the lease (>= 1 s).
        members = f"{key_prefix}:{{peers}}:members"
        with redis.Redis(port=cluster.node_of_key(members).port, decode_responses=True) as admin:
            assert a_id not in admin.smembers(members)
            assert not admin.exists(f"{key_prefix}:{{peers}}:r:{a_id}")
        poll(lambda: b.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 1, "B to see A gone")


def test_a_frozen_shard_opens_the_breaker_and_requests_are_still_served(redis_cluster_nodes: RedisCluster,
                                                                        key_prefix: str) -> None:
    cluster = redis_cluster_nodes
    shard = cluster.node_of_key(f"{key_prefix}:{{{QWEN}}}:clock")
    index = cluster_index(cluster, key_prefix, timeout_s=0.05, breaker_failures=3, breaker_open_s=0.3,
                          breaker_max_open_s=0.3, share_load=False)
    with ExitStack() as stack:
        stack.enter_context(cleaned(cluster, key_prefix))
        q = stack.enter_context(run_mock(QWEN))
        gw = stack.enter_context(run_gateway([backend_doc("q0", q, model=QWEN)], index=index))
        poll(lambda: gw.http.get("/v1/kappa/backends").json()["backends"][0]["healthy"], "the mock to be healthy")
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10)

        def ratio() -> float:
            return float(client.chat.completions.with_raw_response.create(**chat(QWEN, "q")).headers["x-kappa-ratio"])

        poll(lambda: ratio() > 0, "the prefix to be recorded and matched")
        with frozen(shard.proc):
            ratios = [ratio() for _ in range(5)]  # every one answered (200), by load alone
            assert ratios[-1] == 0
            assert gw.metric("gateway_index_degraded") == 1
            assert gw.metric("gateway_index_skipped_total", op="match") >= 1
        poll(lambda: ratio() > 0, "the half-open probe to close the breaker and matches to come back")
        assert gw.metric("gateway_index_degraded") == 0


def _backend(gw: Gateway, backend_id: str) -> dict:
    return next(x for x in gw.http.get("/v1/kappa/backends").json()["backends"] if x["id"] == backend_id)


def _quietly(client: openai.OpenAI, body: dict) -> None:
    """A request held by the hanging fake until the first-byte deadline (504): only its being in
    flight is under test."""
    try:
        client.chat.completions.create(**body)
    except openai.APIError:
        pass

