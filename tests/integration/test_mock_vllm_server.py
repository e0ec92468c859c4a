"""The mock vLLM server over a real uvicorn on 127.0.0.1, driven by the official `openai` client.

llama-3.1-8b on h100-sxm at time-scale 0.01 (100× faster than real time); the context is
cut to 8192 tokens so an over-long prompt is cheap to build. Each test uses prompts of its
own (a fresh nonce first) so that the shared server's prefix cache cannot couple tests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.server import MOCK_VERSION, create_app
from mock_vllm.types import EngineConfig
from router.cost import BackendSpec
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16
TIME_SCALE = 0.01
POLL_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.01
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Mock:
    url: str
    engine: MockEngine
    http: httpx.Client
    client: openai.OpenAI


def _mock(time_scale: float) -> Iterator[Mock]:
    catalog = default_catalog()
    engine = MockEngine(BackendSpec(model=catalog.model(MODEL), hardware=catalog.hw("h100-sxm")),
                        EngineConfig(max_model_len_tokens=MAX_MODEL_LEN))
    app = create_app(engine, served_model_name=MODEL, time_scale=time_scale, registry=CollectorRegistry())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield Mock(url, engine, http, client)


@pytest.fixture(scope="module")
def mock() -> Iterator[Mock]:
    yield from _mock(TIME_SCALE)


def nonce() -> str:
    return uuid.uuid4().hex


def long_text(words: int) -> str:
    return nonce() + " " + " ".join(f"word{i % 97} about topic {i % 13}." for i in range(words))


def metric(mock: Mock, sample: str, **labels: str) -> float:
    """One sample's value from ``/metrics`` (parsed with prometheus_client's parser)."""
    text = mock.http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample)


def poll(condition, what: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_INTERVAL_S)  # poll interval, not a readiness guess


def chat(mock: Mock, content: str, **kwargs):
    return mock.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# -- generation ------------------------------------------------------------------------------
def test_chat_non_stream_parses_with_usage(mock: Mock) -> None:
    resp = chat(mock, f"{nonce()} Hello there", max_tokens=7)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_include_usage_matches_non_stream(mock: Mock) -> None:
    content = f"{nonce()} Stream me"
    chunks = list(chat(mock, content, max_completion_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first, last_content, usage_chunk = chunks[0], chunks[-2], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert last_content.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 0  # a fresh nonce: nothing cached yet
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    again = chat(mock, content, max_tokens=6)
    assert streamed == again.choices[0].message.content  # deterministic text
    # The stream left the prompt's full blocks cached; vLLM recomputes at least the last prompt
    # token, so the hit is the full blocks of the first prompt_tokens - 1 tokens.
    prompt_tokens = usage_chunk.usage.prompt_tokens
    assert again.usage.prompt_tokens == prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_continuous_usage_stats_puts_usage_on_every_chunk(mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce()}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with mock.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        payloads = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                    if line.startswith("data: {")]
    assert all("usage" in p for p in payloads)
    assert payloads[-1]["usage"]["completion_tokens"] == 3


def test_chat_stream_without_usage_ends_with_done(mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce()}], "max_tokens": 3, "stream": True}
    with mock.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("usage" not in p and p["choices"] for p in payloads)


@pytest.mark.parametrize(
    "prompt",
    [f"{nonce()} Once upon a time", [f"{nonce()} one string in a list"], [5001, 5002, 5003, 5004], [[7, 8, 9]]],
    ids=["string", "list-of-one-string", "token-ids", "list-of-one-id-list"],
)
def test_completions_non_stream_parse(mock: Mock, prompt) -> None:
    resp = mock.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].text
    assert resp.usage.completion_tokens == 4 and resp.usage.prompt_tokens_details.cached_tokens == 0
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        assert resp.usage.prompt_tokens == len(prompt)  # token ids bypass the tokenizer


def test_completions_stream_with_usage(mock: Mock) -> None:
    chunks = list(mock.client.completions.create(model=MODEL, prompt=f"{nonce()} Count", max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_same_long_prompt_is_cached_the_second_time(mock: Mock) -> None:
    content = long_text(400)
    hits_before = metric(mock, "vllm:prefix_cache_hits_total")
    queries_before = metric(mock, "vllm:prefix_cache_queries_total")
    first = chat(mock, content, max_tokens=2).usage
    second = chat(mock, content, max_tokens=2).usage
    assert 1800 <= first.prompt_tokens <= 2600 and first.prompt_tokens == second.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens >= second.prompt_tokens - BLOCK_SIZE - 1
    hits = metric(mock, "vllm:prefix_cache_hits_total") - hits_before
    queries = metric(mock, "vllm:prefix_cache_queries_total") - queries_before
    assert hits == second.prompt_tokens_details.cached_tokens
    assert queries == first.prompt_tokens + second.prompt_tokens


def test_cache_salt_separates_caches(mock: Mock) -> None:
    content = long_text(100)

    def cached(salt: str) -> int:
        return chat(mock, content, max_tokens=1, extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") > 0


def test_reset_prefix_cache_forgets_cached_prompts(mock: Mock) -> None:
    content = long_text(100)
    chat(mock, content, max_tokens=1)
    assert chat(mock, content, max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0
    resp = mock.http.post("/reset_prefix_cache")
    assert resp.status_code == 200 and resp.content == b""
    assert chat(mock, content, max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0


def test_x_request_id_is_echoed(mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce()}], "max_tokens": 1}
    resp = mock.http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-42"
    assert resp.json()["id"] == "chatcmpl-trace-42"
    assert mock.http.get("/health", headers={"X-Request-Id": "h1"}).headers["x-request-id"] == "h1"


def test_unknown_fields_are_ignored(mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce(), "name": "bob"}], "max_tokens": 1,
            "priority": 3, "session_id": "s", "kv_transfer_params": {"x": 1}, "cache_salt": "tenant-a", "n": 1}
    assert mock.http.post("/v1/chat/completions", json=body).status_code == 200


# -- errors ----------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "x"}]
ERROR_CASES = [
    ("/v1/chat/completions", b'{"model": "llama-3.1-8b", "messages": [', 400, "JSON"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "n": 2}, 400, "n=2"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"model": "gpt-17", "messages": MSG}, 404, "The model `gpt-17` does not exist."),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": MAX_MODEL_LEN}, 400,
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "out of vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * MAX_MODEL_LEN, "max_tokens": 1}, 400,
     "maximum context length"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), ERROR_CASES,
                         ids=["malformed-json", "messages-not-list", "missing-messages", "max-tokens-zero",
                              "max-tokens-string", "temperature-string", "n-2", "empty-cache-salt",
                              "unknown-model", "chat-over-context", "missing-prompt", "prompt-batch",
                              "empty-prompt", "token-out-of-vocab", "completion-over-context"])
def test_errors_have_vllm_shape(mock: Mock, path: str, body, status: int, needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = mock.http.post(path, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert needle in error["message"] or needle == error["param"], error


def test_tools_nested_near_the_recursion_limit_are_a_400_in_vllm_shape(mock: Mock) -> None:
    """Issue 16: past ~1,000 levels FastAPI cannot parse the body (vLLM answers its
    ``http_exception_handler``'s error body), and a few levels short of that the body parses
    but the chat template cannot render it (vLLM: 400); either way, never a 5xx or a bare
    ``{"detail": ...}``. Which levels fall where depends on the stack, so all are tried."""
    seen = set()
    for levels in range(940, 1_001):
        tools = "[" + '{"a":' * levels + "{}" + "}" * levels + "]"
        content = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "max_tokens": 1, ' \
                  f'"tools": {tools}}}'.encode()
        resp = mock.http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400), (levels, resp.text[:200])
        if resp.status_code == 400:
            error = resp.json()["error"]
            assert set(error) == ERROR_KEYS and error["code"] == 400 and error["type"] == "BadRequestError"
        seen.add(resp.status_code)
    assert seen == {200, 400}


def test_openai_client_raises_typed_errors(mock: Mock) -> None:
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        chat(mock, "x", n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        mock.client.chat.completions.create(model="nope", messages=MSG)


# -- other routes ----------------------------------------------------------------------------
def test_models_health_version(mock: Mock) -> None:
    models = mock.client.models.list()
    card = models.data[0].model_dump()
    assert [m.id for m in models.data] == [MODEL]
    assert card["object"] == "model" and card["owned_by"] == "vllm" and card["root"]
    assert card["max_model_len"] == MAX_MODEL_LEN
    health = mock.http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert mock.http.get("/version").json() == {"version": MOCK_VERSION}


def test_metrics_parse_with_vllm_names_and_labels(mock: Mock) -> None:
    chat(mock, nonce(), max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(mock.http.get("/metrics").text)}
    expected = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
        "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens_by_source",
        "vllm:prompt_tokens_cached_by_source", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "vllm:num_preemptions", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:request_prefill_kv_computed_tokens", "process_start_time_seconds",
        "mock_vllm:power_watts", "mock_vllm:energy_joules", "mock_vllm:host_kv_loaded_bytes", "mock_vllm:kv_pool_loaded_bytes",
        "mock_vllm:schedule_lag_seconds", "mock_vllm:step_lag_seconds", "mock_vllm:schedule_step_seconds",
    }
    assert expected <= set(families)
    assert families["vllm:num_requests_running"].samples[0].labels == {"model_name": MODEL, "engine": "0"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == str(BLOCK_SIZE)
    assert int(info.labels["num_gpu_blocks"]) == mock.engine.stats.num_gpu_blocks > 0
    sources = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples
               if s.name.endswith("_total")}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    assert 0 <= metric(mock, "vllm:kv_cache_usage_perc") <= 1
    assert metric(mock, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(mock, "process_start_time_seconds") > 0
    assert metric(mock, "mock_vllm:energy_joules_total") > 0


def test_latency_histograms_are_in_engine_seconds(mock: Mock) -> None:
    """At time-scale 0.01, an 8B decode step on an H100 is still ~5 ms of engine time, not
    the wall-clock timer slack divided by the time scale."""
    chat(mock, nonce(), max_tokens=40)
    itl_mean_s = metric(mock, "vllm:inter_token_latency_seconds_sum") / metric(
        mock, "vllm:inter_token_latency_seconds_count")
    assert 0.002 < itl_mean_s < 0.02


# -- disconnects -----------------------------------------------------------------------------
@pytest.fixture
def slow_mock() -> Iterator[Mock]:
    """Its own server at time-scale 0.1, so a long stream is still running when the client leaves."""
    yield from _mock(0.1)


def test_client_disconnect_mid_stream_aborts_the_request(slow_mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce()}], "max_tokens": 4000, "stream": True}
    with slow_mock.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
    poll(lambda: metric(slow_mock, "vllm:request_success_total", finished_reason="abort") == 1, "the abort")
    poll(lambda: metric(slow_mock, "vllm:num_requests_running") == 0, "no running requests")
    assert metric(slow_mock, "vllm:request_success_total", finished_reason="length") == 0


def test_client_disconnect_non_stream_aborts_the_request(slow_mock: Mock) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": nonce()}], "max_tokens": 4000}
    with pytest.raises(httpx.ReadTimeout):
        slow_mock.http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    poll(lambda: metric(slow_mock, "vllm:request_success_total", finished_reason="abort") == 1, "the abort")
    poll(lambda: metric(slow_mock, "vllm:num_requests_running") == 0, "no running requests")
