"""The SSE observer (framing by the spec, bytes unchanged) and the vLLM metrics parser, on literal inputs."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet_config import default_catalog
from gateway.backends.scrape import BackendMetrics, parse_vllm_metrics, read_families
from gateway.proxy.sse import SseObserver, error_tail, usage_from_body
from mock_vllm.app_factory import idle_metrics_page


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
    tail = error_tail("backend x failed", "upstream_error", 502)
    first, second = tail.split(b"\n\n")[:2]
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == 502 and second == b"data: [DONE]"


NEWLINES = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def with_newline(stream: bytes, newline: bytes) -> bytes:
    return stream.replace(b"\n", newline)


@pytest.mark.parametrize("newline", list(NEWLINES), ids=list(NEWLINES))
@pytest.mark.parametrize("seed", range(20))
def test_framing_by_the_spec_any_split_bytes_unchanged(newline: str, seed: int) -> None:
    """Regression: events were framed on LF-LF only, so CRLF (sse-starlette) and CR streams got
    no TTFT, ITL or usage. Any line ending, events split anywhere (inside a CRLF pair too),
    several per read: the same figures, and what is relayed is exactly what came."""
    stream = with_newline(ROLE + TOKEN + TOKEN + USAGE + DONE, NEWLINES[newline])
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(stream)), 12))
    obs = SseObserver(start_s=0.0)
    relayed = b""
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(stream)], strict=True)):
        relayed += obs.feed(stream[a:b], float(i))
    relayed += obs.flush()
    assert relayed == stream
    assert obs.first_content_s is not None and len(obs.itl_s) <= 1 and obs.done
    assert obs.usage == {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}


def test_an_incomplete_event_is_held_back_until_it_completes() -> None:
    obs = SseObserver(start_s=0.0)
    assert obs.feed(TOKEN + TOKEN[:10], 1.0) == TOKEN  # the half event waits
    assert obs.holding
    assert obs.feed(TOKEN[10:], 2.0) == TOKEN
    assert not obs.holding and obs.itl_s == [1.0]


def test_a_crlf_split_between_its_cr_and_its_lf_is_one_line_end() -> None:
    crlf = with_newline(TOKEN + DONE, b"\r\n")
    cut = crlf.index(b"\r\n\r\n") + 1  # ... "}" "\r" | "\n\r\n" ...
    obs = SseObserver(start_s=0.0)
    relayed = obs.feed(crlf[:cut], 1.0) + obs.feed(crlf[cut:], 2.0) + obs.flush()
    assert relayed == crlf and obs.ttft_s == 2.0  # complete only once the LF came
    assert obs.done


def test_multi_line_data_is_joined_and_comments_ignored() -> None:
    obs = SseObserver(start_s=0.0)
    obs.feed(b": keep-alive\n\ndata: {\"choices\": [{\"index\": 0,\ndata: \"text\": \"x\"}]}\n\n", 3.0)
    assert obs.ttft_s == 3.0


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
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1500.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 500.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 90.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(VLLM_METRICS)
    assert m == BackendMetrics(num_requests_waiting=7, num_requests_running=5, kv_cache_usage_ratio=0.42,
                               block_size_tokens=16, num_gpu_blocks=27000, process_start_time_s=1.7e9,
                               prefix_cache_queries_tokens=1000.0, prefix_cache_hits_tokens=600.0,
                               prompt_tokens_total=2000.0, generation_tokens_total=90.0, requests_succeeded_total=8.0)


@pytest.mark.parametrize("page", ["", "\n\n", "# HELP x y\n# TYPE x counter\n\n", "process_start_time_seconds 1.7e9\n",
                                  "# TYPE vllm:prompt_tokens counter\nprocess_start_time_seconds 1.7e9\n"])
def test_a_page_without_engine_samples_is_a_failed_scrape(page: str) -> None:
    """Read as all zeros, its counters would look reset: gateway/backends/backend_set.py would take the backend
    for restarted and forget its index entries (it did, for an empty 200 page)."""
    with pytest.raises(ValueError):
        parse_vllm_metrics(page)
    assert parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 0\n') == BackendMetrics()


def test_parse_invalid() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:x{ 1\n")  # no sample read here: not a vLLM page
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_waiting{ 1\n")  # a sample read here, malformed


@pytest.mark.parametrize("page", ["unit", "mock"])
def test_the_lines_read_give_what_the_whole_page_gives(page: str) -> None:
    """Only the samples read go to the parser (gateway/backends/scrape.py): the figures are those of the
    whole page parsed, on this test's page and on the mock vLLM's (~330 lines, ~20 read)."""
    text = VLLM_METRICS if page == "unit" else idle_metrics_page("llama-3.1-8b", "h100-sxm", default_catalog())
    whole = read_families(text_string_to_metric_families(text))
    assert parse_vllm_metrics(text) == whole
    if page == "mock":
        assert whole.num_gpu_blocks and whole.block_size_tokens  # the page has what is read
        unread = text.replace("vllm:time_to_first_token_seconds_bucket{", "vllm:time_to_first_token_seconds_bucket{{")
        assert parse_vllm_metrics(unread) == whole  # a malformed line of a family not read is skipped


@pytest.mark.parametrize("body", ["<html><body>Bad gateway</body></html>\n", '{"error": "upstream"}\n',
                                  "Internal Server Error\n", "upstream connect error or disconnect\n"])
def test_an_error_page_is_a_failed_scrape_not_zero_counters(body: str) -> None:
    """Zeroed counters would read as an engine restart (gateway/backends/backend_set.py forgets its index entries)."""
    with pytest.raises(ValueError):
        parse_vllm_metrics(body)
    if body[0] in "<{":  # a line that cannot start a sample fails the page, whatever else it holds
        with pytest.raises(ValueError):
            parse_vllm_metrics(VLLM_METRICS + body)
    else:  # one that reads as a sample of a family not read is skipped, as any such line is
        assert parse_vllm_metrics(VLLM_METRICS + body) == parse_vllm_metrics(VLLM_METRICS)
