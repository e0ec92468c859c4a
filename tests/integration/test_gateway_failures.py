"""Failures on 127.0.0.1: retries before the first byte only, timeouts, disconnects, Redis and restarts."""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, run_fakes, run_gateway, run_mocks
from tests.support.fake_upstream import Script
from tests.support.redis_server import free_port, redis_server

pytestmark = pytest.mark.integration

CHAT = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
ROUND_ROBIN = {"policy": "round-robin"}  # deterministic order: the first request goes to backend "a"


def post(client: httpx.Client, body: dict, **kw: object) -> httpx.Response:
    return client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"},
                       **kw)


def test_5xx_before_first_byte_is_retried_once_on_the_next_backend() -> None:
    bad, good = Script(mode="status", status=500), Script()
    with run_fakes([bad, good]) as urls, run_gateway(
            [backend_doc("a", urls[0]), backend_doc("b", urls[1])], routing=ROUND_ROBIN) as gw:
        resp = post(gw.http, CHAT)
        assert resp.status_code == 200 and resp.headers["x-kappa-backend"] == "b"
        assert len(bad.received) == 1 and len(good.received) == 1
        assert good.received[0]["body"] == bad.received[0]["body"] == json.dumps(CHAT).encode()
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1


def test_two_failures_give_502_with_an_openai_error() -> None:
    scripts = [Script(mode="status", status=503), Script(mode="status", status=500), Script()]
    with run_fakes(scripts) as urls, run_gateway(
            [backend_doc(b, u) for b, u in zip("abc", urls, strict=True)], routing=ROUND_ROBIN) as gw:
        resp = post(gw.http, CHAT)
        assert resp.status_code == 502 and resp.json()["error"]["code"] == 502
        assert len(scripts[2].received) == 0  # retried once, not twice


def test_first_byte_timeout_is_504() -> None:
    with run_fakes([Script(mode="hang")]) as urls, run_gateway(
            [backend_doc("a", urls[0])], gateway={"upstream_first_byte_timeout_s": 0.2}) as gw:
        resp = post(gw.http, CHAT)
        assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"


def test_connect_error_marks_backend_down_and_retries() -> None:
    good = Script()
    with run_fakes([good]) as urls, run_gateway(
            [backend_doc("dead", f"http://127.0.0.1:{free_port()}"), backend_doc("b", urls[0])],
            routing=ROUND_ROBIN, gateway={"health_interval_s": 60}) as gw:
        # The dead backend never passed a health check, so it is not even a candidate.
        assert gw.http.get("/ready").json()["healthy_backends"] == 1
        assert post(gw.http, CHAT).headers["x-kappa-backend"] == "b"


def test_no_healthy_backend_is_503() -> None:
    with run_gateway([backend_doc("dead", f"http://127.0.0.1:{free_port()}")]) as gw:
        resp = post(gw.http, CHAT)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable_error"
        assert gw.http.get("/ready").status_code == 503


def test_no_retry_after_the_first_byte_and_the_stream_ends_explicitly() -> None:
    dying, other = Script(mode="die_mid_stream", chunks=5), Script()
    with run_fakes([dying, other]) as urls, run_gateway(
            [backend_doc("a", urls[0]), backend_doc("b", urls[1])], routing=ROUND_ROBIN) as gw:
        resp = post(gw.http, {**CHAT, "stream": True})
        events = [e for e in resp.text.split("\n\n") if e]
        assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == "t0"
        assert "error" in json.loads(events[-2].removeprefix("data: "))
        assert events[-1] == "data: [DONE]"
        assert len(other.received) == 0
        assert gw.metric("gateway_requests_total", backend="a", status="upstream_error") == 1


def test_client_disconnect_cancels_the_upstream_stream() -> None:
    slow = Script(chunks=200, chunk_delay_s=0.05)
    with run_fakes([slow]) as urls, run_gateway([backend_doc("a", urls[0])]) as gw:
        with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            first = next(resp.iter_raw())
            assert first.startswith(b"data: ")
        poll(slow.cancelled.is_set, "the upstream stream to be cancelled")
        poll(lambda: gw.metric("gateway_in_flight_requests", backend="a") == 0, "in-flight ledger back to 0")
        assert gw.metric("gateway_requests_total", status="client_disconnect") == 1


def test_client_disconnect_aborts_the_request_in_the_mock_engine() -> None:
    with run_mocks(1, time_scale=0.05) as urls, run_gateway([backend_doc("a", urls[0])]) as gw, \
            httpx.Client(base_url=urls[0]) as mock:
        with gw.http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 2_000, "stream": True}) as resp:
            next(resp.iter_raw())

        def aborted() -> bool:
            text = mock.get("/metrics").text
            return 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="llama-3.1-8b"} 1.0' in text
        poll(aborted, "the mock to abort the request")


def test_redis_stopped_mid_run_degrades_routing_not_requests() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "p " * 500}]}
    with ExitStack() as stack:
        urls = stack.enter_context(run_mocks(1))
        redis_cm = redis_server()
        redis_url = redis_cm.__enter__()
        stack.callback(redis_cm.__exit__, None, None, None)  # no-op if already stopped below
        gw = stack.enter_context(run_gateway([backend_doc("a", urls[0])],
                                             index={"backend": "redis", "redis_url": redis_url, "timeout_s": 0.1}))
        assert post(gw.http, body).status_code == 200
        assert gw.metric("gateway_index_errors_total") == 0
        redis_cm.__exit__(None, None, None)  # redis-server terminated mid-run
        for _ in range(3):
            assert post(gw.http, body).status_code == 200
        assert gw.metric("gateway_index_errors_total", op="match") == 3


def test_gateway_starts_and_serves_with_redis_unreachable() -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    with run_mocks(1) as urls, run_gateway([backend_doc("a", urls[0])],
                                           index={"backend": "redis", "redis_url": dead_redis, "timeout_s": 0.1}) as gw, \
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
        assert client.completions.create(model=MOCK_MODEL, prompt="shared prefix " * 400, max_tokens=1).usage
        assert gw.metric("gateway_index_errors_total", op="match") == 1


def _new_start_time(script: Script) -> None:
    assert script.process_start_time_s is not None
    script.process_start_time_s += 60


def _counter_backwards(script: Script) -> None:  # restarted within a second: same start time, fresh counters
    script.prefix_cache_queries_tokens = 0.0


@pytest.mark.parametrize(("restart", "start_time_s"), [
    (_new_start_time, 1_000.0), (_counter_backwards, 1_000.0),
    (_counter_backwards, None),  # vLLM with several API servers exports no process_* series: it was never seen
], ids=["start-time", "counter-backwards", "counter-backwards-no-start-time"])
def test_backend_restart_makes_the_index_forget_it(restart, start_time_s: float | None) -> None:
    script = Script(prefix_cache_queries_tokens=50_000.0, process_start_time_s=start_time_s)
    with run_fakes([script]) as urls, run_gateway([backend_doc("a", urls[0])]) as gw:
        body = {"model": MOCK_MODEL, "prompt": "restart me " * 300, "max_tokens": 1}
        assert gw.http.post("/v1/completions", json=body).status_code == 200

        def cached() -> int:
            return gw.http.post("/v1/kappa/route", json=body).json()["candidates"][0]["cached_hbm_tokens"]
        poll(lambda: cached() > 0, "the index to record the prompt")
        restart(script)  # the backend "restarted"
        poll(lambda: cached() == 0, "the index to forget the restarted backend")


def test_authorization_is_forwarded_and_hop_by_hop_headers_are_not() -> None:
    script = Script()
    with run_fakes([script]) as urls, run_gateway([backend_doc("a", urls[0])]) as gw:
        resp = gw.http.post("/v1/chat/completions", json=CHAT, headers={
            "authorization": "Bearer sk-secret", "x-custom": "kept", "keep-alive": "timeout=5", "te": "trailers"})
        assert resp.status_code == 200
        seen = script.received[0]["headers"]
        assert seen["authorization"] == "Bearer sk-secret" and seen["x-custom"] == "kept"
        assert "keep-alive" not in seen and "te" not in seen
        assert seen["x-request-id"].startswith(resp.headers["x-request-id"] + "-")  # each attempt its own id


def test_a_request_the_backend_rejects_leaves_nothing_in_the_index() -> None:
    """Regression: a 4xx reply (n=2, context too long) was recorded as cached blocks."""
    script = Script(mode="status", status=400)
    with run_fakes([script]) as urls, run_gateway([backend_doc("a", urls[0])]) as gw:
        body = {"model": MOCK_MODEL, "prompt": "rejected prompt " * 400, "max_tokens": 1, "n": 2}
        resp = gw.http.post("/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "scripted failure"
        script.mode = "ok"  # the next (successful) request shows what the index believed
        explained = gw.http.post("/v1/kappa/route", json=body).json()
        assert explained["candidates"][0]["cached_hbm_tokens"] == 0


def test_gateway_errors_echo_the_request_id_and_are_counted() -> None:
    with run_fakes([Script()]) as urls, run_gateway([backend_doc("a", urls[0])]) as gw:
        bad = gw.http.post("/v1/chat/completions", content=b"{oops", headers={"x-request-id": "mine-1"})
        unknown = gw.http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "mine-1"
        assert unknown.status_code == 404 and unknown.headers["x-request-id"]
        assert gw.metric("gateway_requests_total", backend="none", status="400") == 1
        assert gw.metric("gateway_requests_total", backend="none", status="404") == 1


def test_a_backend_serving_another_model_stays_out_of_rotation() -> None:
    wrong, right = Script(model="llama-3.1-70b"), Script()
    with run_fakes([wrong, right]) as urls, run_gateway([backend_doc("wrong", urls[0]), backend_doc("b", urls[1])]) as gw:
        assert gw.http.get("/ready").json()["healthy_backends"] == 1
        for _ in range(3):
            assert post(gw.http, CHAT).headers["x-kappa-backend"] == "b"
        assert wrong.received == []


def test_a_request_in_flight_makes_its_chain_visible_on_its_backend_until_it_ends() -> None:
    # The backend hangs before the first byte, so the index never records the chain; the
    # routing decision still knows the prefill in flight puts it in that backend's HBM.
    body = {"model": MOCK_MODEL, "prompt": "in flight " * 400, "max_tokens": 1}
    with run_fakes([Script(mode="hang")]) as urls, run_gateway(
            [backend_doc("a", urls[0])], gateway={"upstream_first_byte_timeout_s": 2.0}) as gw:
        def cached() -> int:
            return gw.http.post("/v1/kappa/route", json=body).json()["candidates"][0]["cached_hbm_tokens"]

        assert cached() == 0
        answer: dict[str, int] = {}
        sender = threading.Thread(target=lambda: answer.update(
            status=gw.http.post("/v1/completions", json=body).status_code))
        sender.start()
        poll(lambda: cached() > 0, "the in-flight chain to show on its backend")
        sender.join()
        assert answer["status"] == 504
        assert cached() == 0  # it ended without a first byte: nothing cached, nothing pending
