"""Gateway replicas on one Redis see each other's load and prefills in flight (gateway.replicas.peer_load).

Real gateways (two in threads; one as a ``serve`` process killed with SIGKILL) on a real
redis-server, in front of real fake upstreams that hang, so requests stay in flight.
Before this, each replica saw only its own requests: the other's in-flight count read 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from gateway.commands.processes import free_port, stop_processes
from tests.integration.gateway_support import backend_doc, poll, redis_index, run_fakes, run_gateway
from tests.reliability.relay_support import REPO_ROOT, get_status
from tests.support.fake_upstream import Script

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(90)]

MODEL = "llama-3.1-8b"
DOCUMENT = "The annual report of a company that makes ball bearings. " * 400


def chat(question: str) -> dict:
    return {"model": MODEL, "max_tokens": 8,
            "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]}


def backends_of(http: httpx.Client) -> dict[str, dict]:
    return {b["id"]: b for b in http.get("/v1/kappa/backends").json()["backends"]}


def hold(url: str, n: int) -> list[threading.Thread]:
    """``n`` requests that wait on a hanging backend until the first-byte deadline (or their
    gateway dies: what they get back is not under test)."""
    def one() -> None:
        try:
            httpx.post(f"{url}/v1/chat/completions", json=chat("q"), timeout=30)
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_replica_sees_the_others_requests_in_flight_until_they_end(redis_url: str, key_prefix: str) -> None:
    hang = Script(mode="hang")
    edge = {"upstream_first_byte_timeout_s": 4}
    with ExitStack() as stack:
        (url,) = stack.enter_context(run_fakes([hang]))
        index = stack.enter_context(redis_index(redis_url, key_prefix))
        index["load_sync_interval_s"] = 0.02
        a = stack.enter_context(run_gateway([backend_doc("x", url)], index=index, gateway=edge))
        b = stack.enter_context(run_gateway([backend_doc("x", url)], index=index, gateway=edge))
        poll(lambda: b.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 2, "the replicas to meet")
        threads = hold(a.url, 3)
        seen = poll(lambda: (x := backends_of(b.http)["x"])["peer_in_flight"] == 3 and x, "B to see A's requests")
        assert seen["in_flight"] == 0 and seen["peer_kv_demand_bytes"] > 0
        assert backends_of(a.http)["x"]["peer_in_flight"] == 0  # A counts its own as its own, not twice
        for t in threads:
            t.join()  # the deadline ends them (504)
        poll(lambda: backends_of(b.http)["x"]["peer_in_flight"] == 0, "B to see them end")


def test_a_prefill_in_flight_on_one_replica_is_matched_by_the_other(redis_url: str, key_prefix: str) -> None:
    hang = Script(mode="hang")  # x never answers: A's request never reaches its first byte
    with ExitStack() as stack:
        (url,) = stack.enter_context(run_fakes([hang]))
        index = stack.enter_context(redis_index(redis_url, key_prefix))
        fleet = [backend_doc("x", url)]
        a = stack.enter_context(run_gateway(fleet, index=index, gateway={"upstream_first_byte_timeout_s": 4}))
        b = stack.enter_context(run_gateway(fleet, index=index))

        def cached_on_b() -> int:
            (x,) = b.http.post("/v1/kappa/route", json=chat("second question")).json()["candidates"]
            return x["cached_hbm_tokens"]

        assert cached_on_b() == 0
        threads = hold(a.url, 1)
        poll(lambda: len(hang.received) == 1, "A's request to reach x")
        cached = poll(cached_on_b, "B to match the prefill A has in flight on x")
        assert cached > len(DOCUMENT) // 8  # the document, not just a block
        for t in threads:
            t.join()


def test_a_killed_replicas_load_vanishes_with_its_lease(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    hang = Script(mode="hang")
    with ExitStack() as stack:
        (url,) = stack.enter_context(run_fakes([hang]))
        index = stack.enter_context(redis_index(redis_url, key_prefix))
        port = free_port()
        config = tmp_path / "fleet.yaml"
        config.write_text(yaml.safe_dump({"gateway": {"port": port, "upstream_first_byte_timeout_s": 60},
                                          "index": index, "backends": [backend_doc("x", url)]}))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                 "warning"], cwd=REPO_ROOT)
        try:
            poll(lambda: get_status(f"http://127.0.0.1:{port}", "/ready") == 200, "the process replica", timeout_s=30)
            b = stack.enter_context(run_gateway([backend_doc("x", url)], index=index))
            hold(f"http://127.0.0.1:{port}", 2)
            poll(lambda: backends_of(b.http)["x"]["peer_in_flight"] == 2, "B to see the process's requests")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # No clean withdrawal: the lease (20 sync intervals, at least 1 s) must end it.
            poll(lambda: backends_of(b.http)["x"]["peer_in_flight"] == 0, "the dead replica's load to expire",
                 timeout_s=5)
            assert b.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 1
        finally:
            stop_processes([proc])


def test_a_decision_reads_the_others_latest_charges_not_the_last_periodic_exchange(redis_url: str,
                                                                                   key_prefix: str) -> None:
    """Mooncake's bursts arrive within a millisecond: a replica must see a charge the other made
    a moment ago (written when made, read by the decision), not one periodic exchange later.
    A replica writes per charge once it knows another is there (its periodic exchange, here
    every 3 s, tells it); B must see A's charges well within one such period."""
    hang = Script(mode="hang")
    with ExitStack() as stack:
        (url,) = stack.enter_context(run_fakes([hang]))
        index = stack.enter_context(redis_index(redis_url, key_prefix))
        index["load_sync_interval_s"] = 3.0  # the periodic exchange cannot explain what follows in 0.5 s
        a = stack.enter_context(run_gateway([backend_doc("x", url)], index=index,
                                            gateway={"upstream_first_byte_timeout_s": 4}))
        members = stack.enter_context(redis.Redis.from_url(redis_url))
        poll(lambda: members.scard(f"{key_prefix}:{{peers}}:members") == 1, "A to join before B starts")
        b = stack.enter_context(run_gateway([backend_doc("x", url)], index=index))
        assert b.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 2  # B's first exchange saw A
        poll(lambda: a.http.get("/v1/kappa/backends").json()["peers"]["replicas_seen"] == 2,
             "A's periodic exchange to see B", timeout_s=8)
        threads = hold(a.url, 2)
        poll(lambda: len(hang.received) == 2, "A's requests to reach x")

        def seen_by_b_decision() -> int:
            b.http.post("/v1/kappa/route", json=chat("another"))  # a decision: reads the peers' figures
            return backends_of(b.http)["x"]["peer_in_flight"]

        poll(lambda: seen_by_b_decision() == 2, "B's next decision to see A's two charges", timeout_s=0.5)
        for t in threads:
            t.join()


def test_a_replica_alone_writes_its_load_only_in_its_periodic_exchange(redis_url: str, key_prefix: str) -> None:
    """Nobody reads a lone replica's per-request figures: its requests cost no Redis write for
    them (issue 14: that write was ~5% of the gateway's CPU per request); its periodic exchange
    still publishes them for a replica that joins."""
    with ExitStack() as stack:
        (url,) = stack.enter_context(run_fakes([Script()]))
        index = stack.enter_context(redis_index(redis_url, key_prefix))
        index["load_sync_interval_s"] = 30.0
        a = stack.enter_context(run_gateway([backend_doc("x", url)], index=index))
        client = stack.enter_context(redis.Redis.from_url(redis_url))
        poll(lambda: client.scard(f"{key_prefix}:{{peers}}:members") == 1, "A to join")

        def hset_calls() -> int:
            return int(client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0))

        before = hset_calls()
        for i in range(20):
            assert httpx.post(f"{a.url}/v1/chat/completions", json=chat(f"q{i}"), timeout=10).status_code == 200
        assert hset_calls() - before < 5  # 20 requests, 60 ledger changes: no write per change
        assert client.hgetall(f"{key_prefix}:{{peers}}:r:" + client.smembers(f"{key_prefix}:{{peers}}:members").pop().decode())
