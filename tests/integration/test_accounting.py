"""Issue 13, items 5–7: time to response headers, series born at zero, and ``n`` in the KV charge.

A real gateway over two real mocks on 127.0.0.1; requests through the official ``openai`` client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway_support import (
    MOCK_MODEL,
    Gateway,
    backend_doc,
    poll,
    run_gateway,
    run_mocks,
)

pytestmark = pytest.mark.integration

B_KV_LLAMA_8B = 131_072  # bytes/token: 2 · 32 layers · 8 KV heads · 128 · 2 bytes (REFERENCE.md §1)


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with run_mocks(2) as urls, run_gateway([backend_doc("a", urls[0]), backend_doc("b", urls[1], "b200")]) as g:
        poll(lambda: g.http.get("/ready").status_code == 200, "gateway ready")
        yield g


@pytest.fixture
def client(gw: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0, timeout=30) as c:
        yield c


def samples(gw: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(gw.http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_fresh_gateway_exports_every_request_series_at_zero() -> None:
    """Item 6: ``rate()`` sees a counter rise only if the series existed before its first
    increment; the dashboard's transfer-bound share read 0 because ``regime="transfer"`` was born at 1."""
    with run_mocks(1) as urls, run_gateway([backend_doc("a", urls[0])]) as fresh:
        poll(lambda: fresh.http.get("/ready").status_code == 200, "gateway ready")
        got = samples(fresh)
    for regime in ("compute", "transfer"):
        for status in ("ok", "upstream_error", "upstream_timeout", "client_disconnect"):
            labels = (("backend", "a"), ("model", MOCK_MODEL), ("policy", "kappa"), ("regime", regime),
                      ("status", status))
            assert got[("gateway_requests_total", labels)] == 0.0
    assert got[("gateway_requests_total", (("backend", "none"), ("model", "none"), ("policy", "kappa"),
                                           ("regime", "none"), ("status", "503")))] == 0.0
    # the per-backend histograms the dashboard rates, and the headers time by stream
    assert got[("gateway_ttft_seconds_count", (("backend", "a"),))] == 0.0
    assert got[("gateway_kappa_ratio_count", (("backend", "a"),))] == 0.0
    assert got[("gateway_prompt_tokens_total", (("backend", "a"), ("source", "cached_host")))] == 0.0
    for stream in ("true", "false"):
        assert got[("gateway_time_to_response_headers_seconds_count", (("backend", "a"), ("stream", stream)))] == 0.0


def test_non_streamed_requests_get_a_time_to_response_headers_and_no_ttft(gw: Gateway, client: openai.OpenAI) -> None:
    """Item 5: TTFT is a stream's; a non-streamed answer is timed to its response headers instead."""

    def grew(before: dict, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return samples(gw).get(key, 0.0) - before.get(key, 0.0)

    before = samples(gw)
    raw = client.chat.completions.with_raw_response.create(
        model=MOCK_MODEL, messages=[{"role": "user", "content": "time me whole"}], max_tokens=8)
    backend = raw.headers["x-kappa-backend"]  # a non-streamed answer is settled before it is sent
    assert grew(before, "gateway_time_to_response_headers_seconds_count", backend=backend, stream="false") == 1
    assert grew(before, "gateway_time_to_response_headers_seconds_count", backend=backend, stream="true") == 0
    assert grew(before, "gateway_ttft_seconds_count", backend=backend) == 0

    before = samples(gw)
    raw_stream = client.chat.completions.with_raw_response.create(
        model=MOCK_MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=4, stream=True)
    backend = raw_stream.headers["x-kappa-backend"]
    assert len(list(raw_stream.parse())) >= 4
    poll(lambda: grew(before, "gateway_time_to_response_headers_seconds_count", backend=backend, stream="true") == 1,
         "the stream settled")  # a stream is settled after its last byte went out
    assert grew(before, "gateway_ttft_seconds_count", backend=backend) == 1
    assert grew(before, "gateway_time_to_response_headers_seconds_count", backend=backend, stream="false") == 0


def test_help_text_says_what_each_time_measures(gw: Gateway) -> None:
    helps = {f.name: f.documentation for f in text_string_to_metric_families(gw.http.get("/metrics").text)}
    assert helps["gateway_ttft_seconds"].startswith("Streamed requests only")
    assert "gateway_time_to_response_headers_seconds" in helps["gateway_ttft_seconds"]
    assert "stream=false" in helps["gateway_time_to_response_headers_seconds"]


def explain(gw: Gateway, **fields: object) -> dict:
    body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "one prompt, several answers " * 40}],
            "max_tokens": 100, **fields}
    return gw.http.post("/v1/kappa/route", json=body).json()


def test_kv_charge_holds_one_prompt_and_n_outputs(gw: Gateway) -> None:
    """Item 7: vLLM fans ``n`` out into n sequences sharing the prompt's blocks: the charge is
    (K + T)·B_kv once plus n·max_tokens·B_kv (llama-3.1-8b: full attention, so exactly linear)."""
    one, three = explain(gw), explain(gw, n=3)
    assert (one["n"], three["n"]) == (1, 3)
    by_backend = {c["backend"]: c["kv_demand_bytes"] for c in one["candidates"]}
    for c in three["candidates"]:
        assert c["kv_demand_bytes"] - by_backend[c["backend"]] == 2 * 100 * B_KV_LLAMA_8B
    # best_of (legacy completions) generates that many sequences server-side: charged as such
    best = explain(gw, n=1, best_of=3)
    assert [c["kv_demand_bytes"] for c in best["candidates"]] == [c["kv_demand_bytes"] for c in three["candidates"]]


@pytest.mark.parametrize("key", ["n", "best_of"])
@pytest.mark.parametrize("value", [0, -1, "2", True, 1.5], ids=["zero", "negative", "string", "bool", "float"])
def test_bad_n_is_a_400_naming_it(gw: Gateway, key: str, value: object) -> None:
    body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}], key: value}
    for path in ("/v1/chat/completions", "/v1/kappa/route"):
        resp = gw.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error == {"message": f"'{key}' must be a positive integer.", "type": error["type"], "param": key,
                         "code": 400}
