"""``replay`` over real HTTP on 127.0.0.1: the mock vLLM server (uvicorn in a thread) and
small aiohttp servers that misbehave on purpose. Failures must come back as results.

The mock runs llama-3.1-8b on h100-sxm at time-scale 0.001 (1000× faster than real time);
the Mooncake requests are replayed at speedup 100, so the trace's 3 s between its first
bursts become 30 ms: enough for the first burst's shared block 0 to be cached.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from fleet_config.catalog import default_catalog
from gateway.commands.cli import app as cli_app
from gateway.commands.replay import ReplayError, first_model_id, replay
from gateway.commands.replay_report import summarize
from mock_vllm.engine import MockEngine
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from router.cost import BackendSpec
from sim.traces import TraceRequest, load_mooncake
from tests.support.redis_server import free_port
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
TIME_SCALE = 0.001
SPEEDUP = 100.0
FIRST_BURST = 10  # the trace's first ten requests all arrive at t = 0


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    catalog = default_catalog()
    engine = MockEngine(BackendSpec(model=catalog.model(MODEL), hardware=catalog.hw("h100-sxm")), EngineConfig())
    app = create_app(engine, served_model_name=MODEL, time_scale=TIME_SCALE, registry=CollectorRegistry())
    with serve_in_thread(app) as url:
        yield url


def _small(n: int) -> list[TraceRequest]:
    return [TraceRequest(arrival_s=0.001 * i, input_tokens=40, output_tokens=3) for i in range(n)]


async def test_mooncake_replay_against_mock(real_trace: Callable[[str], Path], mock_url: str) -> None:
    requests = load_mooncake(real_trace("mooncake"), limit=30)
    seen: list[int] = []
    results = await replay(requests, url=mock_url, model=MODEL, speedup=SPEEDUP, concurrency=64,
                           on_result=lambda r: seen.append(r.index), progress=False)
    assert [r.index for r in results] == list(range(30)) and sorted(seen) == list(range(30))
    assert [r.error for r in results if r.error] == []
    for r, req in zip(results, requests):
        assert r.status == 200 and r.request_id is not None and r.request_id.endswith(f"-{r.index}")
        assert r.prompt_tokens is not None and r.prompt_tokens >= req.input_tokens
        assert r.completion_tokens == req.output_tokens
        assert r.cached_tokens is not None and 0 <= r.cached_tokens < r.prompt_tokens
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.sent_s >= req.arrival_s / SPEEDUP - 1e-3  # asyncio may wake a timer a tick early
        assert r.backend is None and r.regime is None  # the mock sends no x-kappa-* headers
    later = results[FIRST_BURST:]
    assert all(r.cached_tokens for r in later), [r.cached_tokens for r in later]  # block 0 is shared by all
    summary = summarize(results)
    assert summary["errors"] == 0 and summary["ok"] == 30
    assert 0 < summary["cached_token_ratio"] < 1
    assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
    assert summary["backends"] == {} and summary["regimes"] == {}


def test_cli_json_summary_and_out_file(real_trace: Callable[[str], Path], mock_url: str, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    result = CliRunner().invoke(cli_app, [
        "replay", str(real_trace("mooncake")), "--url", f"{mock_url}/v1", "--limit", "12",
        "--speedup", str(SPEEDUP), "--concurrency", "4", "--out", str(out), "--json",
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == 12 and summary["errors"] == 0 and summary["cached_tokens"] > 0
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(12))
    assert all(line["prompt_tokens"] and line["error"] is None for line in lines)


def test_cli_table_summary(mock_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,300,4\n"
                     "2023-11-16 18:17:04.0319600,200,2\n", encoding="utf-8")
    result = CliRunner().invoke(cli_app, ["replay", str(trace), "--url", mock_url, "--speedup", "10"])
    assert result.exit_code == 0, result.output
    assert "replay summary" in result.stdout and "2 / 2 / 0" in result.stdout


async def test_http_errors_are_results(mock_url: str) -> None:
    results = await replay(_small(3), url=mock_url, model="no-such-model", speedup=10.0, progress=False)
    assert [r.status for r in results] == [404] * 3
    assert all(r.error == "HTTP 404: The model `no-such-model` does not exist." for r in results)
    summary = summarize(results)
    assert summary["errors"] == 3 and summary["error_examples"][0]["count"] == 3


async def test_nothing_listening_gives_error_results() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    results = await replay(_small(4), url=url, model=MODEL, speedup=10.0, progress=False)
    assert len(results) == 4
    assert all(r.status is None and r.error and "Connect" in r.error for r in results), [r.error for r in results]
    assert summarize(results)["ok"] == 0
    with pytest.raises(ReplayError, match="/v1/models failed"):
        await first_model_id(url)


def test_cli_without_server_names_the_url(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n', encoding="utf-8")
    result = CliRunner().invoke(cli_app, ["replay", str(trace), "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 2 and "/v1/models failed" in result.output


async def test_model_discovery(mock_url: str) -> None:
    assert await first_model_id(f"{mock_url}/") == MODEL


async def _misbehaving(request: web.Request) -> web.StreamResponse:
    """Streams one content chunk, then: ``cut`` stops without [DONE]; ``error`` sends vLLM's
    mid-stream error event and [DONE]; ``garbage`` sends a malformed chunk and [DONE]."""
    body = await request.json()
    mode = body["messages"][0]["content"].split()[0]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kappa-backend": "b1",
                                       "x-kappa-regime": "transfer", "x-kappa-ratio": "12.5", "x-kappa-crit": "bad"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')
    if mode == "error":
        await resp.write(b'data: {"error": {"message": "engine died", "type": "x", "param": null, "code": 500}}\n\n')
    elif mode == "garbage":
        await resp.write(b"data: {not json\n\n")
    if mode != "cut":
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def misbehaving_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _misbehaving)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.parametrize(("mode", "error"), [
    ("cut", "stream ended without data: [DONE]"),
    ("error", "stream error: engine died"),
    ("garbage", "malformed SSE chunk"),
], ids=["no-done", "mid-stream-error", "malformed"])
async def test_broken_streams_are_results(misbehaving_url: str, mode: str, error: str) -> None:
    req = TraceRequest(arrival_s=0.0, input_tokens=2, output_tokens=1,
                       messages=({"role": "user", "content": f"{mode} please"},))
    (result,) = await replay([req], url=misbehaving_url, model=MODEL, progress=False)
    assert result.status == 200 and result.error is not None and result.error.startswith(error)
    assert result.ttft_s is not None and result.prompt_tokens is None
    assert (result.backend, result.regime, result.kappa_ratio, result.kappa_crit) == ("b1", "transfer", 12.5, None)
    summary = summarize([result])
    assert summary["backends"] == {"b1": {"requests": 1, "errors": 1, "regimes": {"transfer": 1}}}


async def test_concurrency_limit_queues_on_the_client(mock_url: str) -> None:
    results = await replay(_small(6), url=mock_url, model=MODEL, speedup=1000.0, concurrency=1, progress=False)
    assert all(r.ok for r in results)
    ordered = sorted(results, key=lambda r: r.sent_s)
    for a, b in zip(ordered, ordered[1:]):  # one slot: each request goes out after the previous ended
        assert b.sent_s >= a.sent_s + (a.e2e_s or 0.0) - 1e-3
    assert sum(r.queue_wait_s > 0 for r in results) >= 4
    assert summarize(results)["client_queued_requests"] >= 1
