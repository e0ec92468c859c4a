"""A real gateway routing on a backend's KV events (a real ZMQ publisher in vLLM's protocol, real mock
backends, real Redis): the exact index's K in the routing decision, the mode in /v1/kappa/backends and
/metrics, and a Redis outage that degrades routing without failing requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.gateway_support import MOCK_MODEL, Gateway, backend_doc, poll, run_gateway, run_mocks
from tests.support.kv_events_publisher import PublisherThread
from tests.support.kv_events_wire import stored
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

PROMPT = list(range(1000, 1074))  # 74 tokens: 4 full engine blocks of 16, then 10 more


@pytest.fixture
def publisher() -> Iterator[PublisherThread]:
    thread = PublisherThread()
    yield thread
    thread.close()


def kv_view(gw: Gateway, backend_id: str) -> dict:
    backends = gw.http.get("/v1/kappa/backends").json()["backends"]
    return next(b for b in backends if b["id"] == backend_id)["kv_events"]


def backends_with_events(urls: list[str], publisher: PublisherThread) -> list[dict]:
    pub = publisher.publisher
    return [backend_doc("b1", urls[0], kv_events={"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}),
            backend_doc("b2", urls[1])]


def explain(gw: Gateway) -> dict:
    answer = gw.http.post("/v1/kappa/route", json={"model": MOCK_MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_routing_uses_the_engines_events(publisher: PublisherThread) -> None:
    with run_mocks(2) as urls, run_gateway(backends_with_events(urls, publisher)) as gw:
        poll(lambda: kv_view(gw, "b1")["mode"] == "exact", "b1 exact")
        assert kv_view(gw, "b2") == {"mode": "approximate", "reason": "no kv_events configured"}
        publisher.publish([stored([7001, 7002, 7003], None, PROMPT[:48], 16),
                           stored([7004], 7003, PROMPT[48:64], 16, medium="CPU")])
        poll(lambda: kv_view(gw, "b1")["last_seq"] == 0, "the batch applied")
        view = kv_view(gw, "b1")
        assert (view["exact_blocks"], view["block_size_tokens"]) == ({"hbm": 3, "host": 1}, 16)
        plan = explain(gw)
        by_backend = {c["backend"]: c for c in plan["candidates"]}
        assert (by_backend["b1"]["cached_hbm_tokens"], by_backend["b1"]["cached_host_tokens"]) == (48, 16)
        assert (by_backend["b2"]["cached_hbm_tokens"], by_backend["b2"]["cached_host_tokens"]) == (0, 0)
        assert plan["prompt_tokens_estimate"] == 74  # counted, not estimated: the token ids are known
        assert by_backend["b1"]["uncached_prompt_tokens"] == 10
        assert gw.metric("gateway_kv_events_mode", backend="b1", mode="exact") == 1
        assert gw.metric("gateway_kv_events_mode", backend="b2", mode="approximate") == 1
        assert gw.metric("gateway_kv_events_batches_total", backend="b1", outcome="applied") == 1
        assert gw.metric("gateway_kv_events_exact_blocks", backend="b1", tier="host") == 1
        answer = gw.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert answer.status_code == 200, answer.text


@pytest.mark.redis
def test_redis_down_degrades_routing_and_fails_no_request(publisher: PublisherThread) -> None:
    dead = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}", "timeout_s": 0.05}
    with run_mocks(2) as urls, run_gateway(backends_with_events(urls, publisher), index=dead) as gw:
        publisher.publish([stored([7001], None, PROMPT[:16], 16)])
        poll(lambda: kv_view(gw, "b1")["mode"] == "degraded", "b1 degraded: its store is down")
        assert kv_view(gw, "b1")["reason"] == "index store unavailable"
        plan = explain(gw)
        assert all(c["cached_hbm_tokens"] == 0 for c in plan["candidates"])
        for _ in range(3):
            answer = gw.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
