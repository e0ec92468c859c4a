"""The gateway end to end on 127.0.0.1: the openai client through a real gateway to real mocks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.integration.gateway_support import MOCK_MODEL, Gateway, backend_doc, poll, run_gateway, run_mocks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with run_mocks(2) as urls, run_gateway([backend_doc("a", urls[0]), backend_doc("b", urls[1], "b200")],
                                           gateway={"max_body_bytes": 200_000}) as g:
        poll(lambda: g.http.get("/ready").status_code == 200, "gateway ready")
        yield g


@pytest.fixture
def client(gw: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0, timeout=30) as c:
        yield c


def long_prompt(tag: str, words: int = 1_500) -> str:
    return tag + " " + " ".join(f"w{i % 89} fact {i % 7}." for i in range(words))


def test_chat_non_stream_with_kappa_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MOCK_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    assert raw.headers["x-kappa-backend"] in {"a", "b"}
    assert raw.headers["x-kappa-regime"] in {"compute", "transfer"}
    float(raw.headers["x-kappa-ratio"])
    assert raw.headers["x-request-id"]


def test_chat_stream_with_usage_passes_through(client: openai.OpenAI, gw: Gateway) -> None:
    stream = client.chat.completions.create(
        model=MOCK_MODEL, messages=[{"role": "user", "content": long_prompt("stream")}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert gw.metric("gateway_ttft_seconds_count") >= 1


def test_second_turn_is_routed_to_its_cache_and_reported_cached(client: openai.OpenAI, gw: Gateway) -> None:
    prompt = long_prompt("affinity")
    first = client.completions.with_raw_response.create(model=MOCK_MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.with_raw_response.create(model=MOCK_MODEL, prompt=prompt + " and more", max_tokens=2)
    assert second.headers["x-kappa-backend"] == first.headers["x-kappa-backend"]
    assert float(second.headers["x-kappa-ratio"]) > 10
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0.9 * first.parse().usage.prompt_tokens


def test_completions_stream_and_token_id_prompts(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MOCK_MODEL, prompt="count:", max_tokens=3, stream=True)
    assert sum(1 for c in stream if c.choices and c.choices[0].text) == 3
    ids = list(range(100, 400))
    result = client.completions.create(model=MOCK_MODEL, prompt=ids, max_tokens=2)
    assert result.usage.prompt_tokens == 300


def test_body_and_unknown_fields_reach_the_backend_unchanged(gw: Gateway) -> None:
    body = {"model": MOCK_MODEL, "prompt": "x", "max_tokens": 1, "priority": 3, "vendor_extra": {"k": [1, 2]}}
    resp = gw.http.post("/v1/completions", content=json.dumps(body),
                        headers={"x-request-id": "req-42", "content-type": "application/json"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "req-42"
    assert resp.json()["id"].startswith("cmpl-req-42-")  # the mock names completions after X-Request-Id: the attempt's id


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "model"),
        (json.dumps({"model": MOCK_MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MOCK_MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
         400, "max_tokens"),
        (json.dumps({"model": MOCK_MODEL, "messages": [{"role": "user", "content": 5}]}).encode(), 400, "messages"),
        (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
        (json.dumps({"model": MOCK_MODEL, "messages": [{"role": "user", "content": "x" * 250_000}]}).encode(), 413, None),
    ],
    ids=["malformed", "not-object", "no-model", "no-messages", "messages-string", "max-tokens-0", "content-int",
         "unknown-model", "oversized"],
)
def test_bad_requests_get_openai_errors(gw: Gateway, body: bytes, status: int, param: str | None) -> None:
    resp = gw.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "Invalid JSON body: "),
        (b"[1, 2]", "The request body must be a JSON object."),
        (json.dumps({"model": MOCK_MODEL}).encode(), "The body needs 'messages' (chat) or 'prompt' (completions)."),
        (json.dumps({"model": MOCK_MODEL, "messages": "hi"}).encode(), "'messages' must be a non-empty array."),
    ],
    ids=["malformed", "not-object", "neither-messages-nor-prompt", "messages-string"],
)
def test_explain_route_answers_bad_bodies_like_the_proxy(gw: Gateway, body: bytes, message: str) -> None:
    resp = gw.http.post("/v1/kappa/route", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(message)


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_models_health_ready_backends_and_explain(gw: Gateway) -> None:
    assert [m["id"] for m in gw.http.get("/v1/models").json()["data"]] == [MOCK_MODEL]
    assert gw.http.get("/health").status_code == 200
    assert gw.http.get("/ready").json()["healthy_backends"] == 2
    backends = {b["id"]: b for b in gw.http.get("/v1/kappa/backends").json()["backends"]}
    assert backends["b"]["hardware"] == "b200" and backends["a"]["kappa_crit_linear"] > 0 and backends["a"]["healthy"]
    explained = gw.http.post("/v1/kappa/route", json={"model": MOCK_MODEL, "prompt": long_prompt("explain")}).json()
    assert {c["backend"] for c in explained["candidates"]} == {"a", "b"}
    assert explained["chosen"] == explained["candidates"][0]["backend"]
    assert {"kappa_ratio", "kappa_ratio_loaded", "kappa_crit", "kappa_crit_linear", "regime", "predicted_ttft_s",
            "predicted_energy_j"} <= set(explained["candidates"][0])
    for c in explained["candidates"]:  # the decode each would join (router.decode): nothing in flight here
        assert c["predicted_e2e_s"] == pytest.approx(c["predicted_ttft_s"] + c["predicted_decode_s"])
        assert c["predicted_itl_s"] > 0 and c["decode_batch_requests"] == 0 and c["predicted_interference_s"] == 0
    assert explained["reason"].startswith("least predicted E2E")


def explain_cached(gw: Gateway, body: dict) -> int:
    out = gw.http.post("/v1/kappa/route", json=body).json()
    return max(c["cached_hbm_tokens"] + c["cached_host_tokens"] for c in out["candidates"])


def test_parts_tools_and_cache_salt_shape_the_hash(gw: Gateway, client: openai.OpenAI) -> None:
    text = long_prompt("hash-shape", 800)
    messages = [{"role": "user", "content": text}]
    client.chat.completions.create(model=MOCK_MODEL, messages=messages, max_tokens=1)
    poll(lambda: explain_cached(gw, {"model": MOCK_MODEL, "messages": messages}) > 0, "index record")
    as_parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    assert explain_cached(gw, {"model": MOCK_MODEL, "messages": as_parts}) > 0  # same bytes as the string
    assert explain_cached(gw, {"model": MOCK_MODEL, "messages": messages, "cache_salt": "tenant-b"}) == 0
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert explain_cached(gw, {"model": MOCK_MODEL, "messages": messages, "tools": tools}) == 0
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                          {"type": "text", "text": text}]}]
    assert explain_cached(gw, {"model": MOCK_MODEL, "messages": image}) == 0
