"""The Redis index and the load exchange behind Redis Sentinel (issue 15), on loopback.

A real master, a replica of it and a Sentinel monitoring them (``redis-server --sentinel``,
``tests/support/redis_sentinel.py``); the gateway reaches them through the index URL
``redis+sentinel://127.0.0.1:<sentinel port>/<service>/0`` (`prefix_index.redis_connect`).
After the master crashes and the Sentinel fails over, the index follows the new master: what
was replicated still matches and new records land there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from prefix_index import IndexUnavailable, TierCapacity
from prefix_index.redis_index import RedisPrefixIndex
from tests.integration.gateway_support import backend_doc, poll, run_gateway, run_mocks
from tests.support.redis_sentinel import SentinelSetup, redis_sentinel

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(60)]

ROOMY = TierCapacity(hbm_blocks=1000, host_blocks=1000)
DOCUMENT = "Survey of the northern orchards: yields, frost, pruning schedules. " * 60


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSetup]:
    """Master + replica + Sentinel, all ``redis-server`` processes (the Sentinel with ``--sentinel``)."""
    if shutil.which("redis-server") is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with redis_sentinel(tmp_path) as setup:
        yield setup


def keys_on(port: int, key_prefix: str) -> set[str]:
    with redis.Redis(port=port, decode_responses=True) as client:
        return set(client.scan_iter(match=f"{key_prefix}:*"))


async def test_the_index_follows_the_master_through_a_crash_and_failover(sentinel: SentinelSetup,
                                                                        key_prefix: str) -> None:
    old_master = sentinel.master_port()
    index = RedisPrefixIndex.from_url(sentinel.url, key_prefix=key_prefix, timeout_s=1.0)
    try:
        await index.record("m1", "b1", [1, 2, 3], ROOMY)
        assert (await index.match("m1", [1, 2, 3], {"b1": ROOMY}))["b1"].matched_blocks == 3
        assert f"{key_prefix}:{{m1}}:blocks:b1" in keys_on(old_master, key_prefix)
        with redis.Redis(port=old_master) as master:
            master.execute_command("WAIT", 1, 2000)  # the record reached the replica before the failover

        new_master = sentinel.kill_master()
        assert new_master != old_master
        failures = 0
        for _ in range(3):  # the connection to the dead master fails once; the next asks the Sentinel
            try:
                await index.record("m2", "b1", [4, 5], ROOMY)
                break
            except IndexUnavailable:
                failures += 1
        assert failures <= 1
        assert f"{key_prefix}:{{m2}}:blocks:b1" in keys_on(new_master, key_prefix)
        assert (await index.match("m1", [1, 2, 3], {"b1": ROOMY}))["b1"].matched_blocks == 3  # replicated
        assert (await index.stats()).blocks_by_backend == {"b1": 5}
        await index.forget("b1")
        assert not any(":blocks:" in k for k in keys_on(new_master, key_prefix))
    finally:
        await index.aclose()


def test_a_gateway_on_sentinel_matches_prefixes_and_shares_its_load(sentinel: SentinelSetup,
                                                                   key_prefix: str) -> None:
    index = {"backend": "redis", "redis_url": sentinel.url, "key_prefix": key_prefix, "timeout_s": 1.0}
    body = {"model": "llama-3.1-8b", "max_tokens": 4,
            "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Which rows froze?"}]}
    with run_mocks(2) as urls, \
            run_gateway([backend_doc(f"b{i}", u) for i, u in enumerate(urls)], index=index) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        home = client.chat.completions.with_raw_response.create(**body).headers["x-kappa-backend"]

        def matched() -> tuple[str, float] | None:
            raw = client.chat.completions.with_raw_response.create(**body)
            ratio = float(raw.headers["x-kappa-ratio"])
            return (raw.headers["x-kappa-backend"], ratio) if ratio > 0 else None

        backend, ratio = poll(matched, "the document's prefix to be matched through the Sentinel's master")
        assert backend == home and ratio > 5
        replica_id = gw.http.get("/v1/kappa/backends").json()["peers"]["replica_id"]
        members = f"{key_prefix}:{{peers}}:members"
        with redis.Redis(port=sentinel.master_port(), decode_responses=True) as master:
            poll(lambda: replica_id in master.smembers(members), "the load exchange to publish on the master")
            assert any(":blocks:" in k for k in master.scan_iter(match=f"{key_prefix}:*"))
