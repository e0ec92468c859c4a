"""The SSE observer and the vLLM metrics parser, on literal inputs."""

from __future__ import annotations

import json

import pytest

from gateway.relay import SseObserver, midstream_error_event, usage_from_body
from gateway.scrape import BackendMetrics, parse_vllm_metrics


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": " hi"}}]})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 8}}})
DONE = b"data: [DONE]\n\n"


def test_ttft_is_the_first_content_chunk_not_the_role_chunk() -> None:
    obs = SseObserver(start_s=100.0)
    obs.feed(ROLE, 100.5)
    obs.feed(TOKEN, 101.0)
    obs.feed(TOKEN, 101.25)
    obs.feed(USAGE + DONE, 101.3)
    assert obs.ttft_s == 1.0
    assert obs.itl_s == [0.25]
    assert obs.usage["prompt_tokens_details"]["cached_tokens"] == 8 and obs.done


def test_events_split_across_network_chunks() -> None:
    obs = SseObserver(start_s=0.0)
    stream = ROLE + TOKEN + USAGE + DONE
    for i in range(0, len(stream), 7):
        obs.feed(stream[i:i + 7], float(i))
    assert obs.first_content_s is not None and obs.usage["completion_tokens"] == 2 and obs.done


@pytest.mark.parametrize("payload", [
    {"choices": [{"index": 0, "text": "abc"}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
], ids=["completion-text", "tool-call", "reasoning"])
def test_content_kinds(payload: dict) -> None:
    obs = SseObserver(start_s=0.0)
    obs.feed(event(payload), 2.0)
    assert obs.ttft_s == 2.0


def test_usage_from_body_and_error_tail() -> None:
    assert usage_from_body(b'{"usage": {"prompt_tokens": 3}}') == {"prompt_tokens": 3}
    assert usage_from_body(b"not json") is None and usage_from_body(b"[1]") is None
    tail = midstream_error_event("backend x failed")
    first, second = tail.split(b"\n\n")[:2]
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == 502 and second == b"data: [DONE]"


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000"} 1.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(VLLM_METRICS)
    assert m == BackendMetrics(num_requests_waiting=7, num_requests_running=5, kv_cache_usage_ratio=0.42,
                               block_size_tokens=16, num_gpu_blocks=27000, process_start_time_s=1.7e9,
                               prefix_cache_queries_tokens=1000.0, prefix_cache_hits_tokens=600.0)


def test_parse_empty_and_invalid() -> None:
    assert parse_vllm_metrics("") == BackendMetrics()
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:x{ 1\n")
