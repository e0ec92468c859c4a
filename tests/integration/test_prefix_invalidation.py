"""Prefix invalidation, live (issue 27, item 7): the chat workloads replayed through a real gateway
in front of a real mock backend, with the official openai client, and the counter read from /metrics.

The two workloads hold the same conversations (`sim.workloads.chat`): ``chat`` sends each whole
history, ``chat-sliding-window`` drops the oldest (user, answer) pairs past 4,096 tokens. They are
built at 0.5 requests/s instead of the registry's 4 — the same chats, fewer of them interleaved — so
that 160 requests hold many turns of each conversation, not mostly first appearances. Requests go
one at a time in arrival order (the next turn after the previous one is cached), each run on a
fresh mock, so its cache holds only its own run.

What is compared, from the workload's own numbers (the mock's usage): a request that continues a
conversation seen earlier in the trace prefills, in the whole-history run, the answer and the new
question (``prompt_tokens − cached_tokens``); in the windowed run also every kept message of the
previous turn, since its front changed. The hit-ratio loss of the window is that difference,
Σ(uncached_window − uncached_whole) over those requests (the first appearance of a conversation
is cold in both runs and is left out: the windowed prompt is shorter there, which is not a lost
hit); the window's hit ratio over the same requests would be that much higher had it only been
appended to. ``gateway_prefix_invalidated_tokens_total{cause="front_truncation"}`` must account for
≥ 90% of it (and not over-count it by more than 10%), and count 0 tokens on the whole-history chat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from gateway.commands.analyze import analyze_access_log, config_rows, read_access_log
from fleet_config import default_catalog, parse_settings
from sim.traces import TraceRequest
from sim.workloads.chat import DEFAULT_WINDOW_TOKENS, multi_turn_chat
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, run_gateway, run_mocks

pytestmark = pytest.mark.integration

REQUESTS = 160
RATE_RPS = 0.5
SEED = 3


@dataclass
class Run:
    prompt_tokens: list[int]
    cached_tokens: list[int]
    invalidated: dict[str, float]  # cause -> tokens, from /metrics
    invalidations: float  # requests with a finding, from /metrics


def replay(trace: list[TraceRequest]) -> Run:
    """Send ``trace`` through a fresh gateway and mock, one request at a time, in arrival order."""
    with run_mocks(1) as urls, run_gateway([backend_doc("m", urls[0])]) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "gateway ready")
        prompts, cached = [], []
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for req in trace:
                usage = client.chat.completions.create(model=MOCK_MODEL, messages=list(req.messages),
                                                       max_tokens=1).usage
                prompts.append(usage.prompt_tokens)
                cached.append(usage.prompt_tokens_details.cached_tokens)
        causes = ("front_truncation", "compaction", "edit", "reorder")
        invalidated = {c: gw.metric("gateway_prefix_invalidated_tokens_total", model=MOCK_MODEL, cause=c)
                       for c in causes}
        return Run(prompts, cached, invalidated, gw.metric("gateway_prefix_invalidations_total"))


@pytest.fixture(scope="module")
def traces() -> dict[str, list[TraceRequest]]:
    return {"chat": multi_turn_chat(REQUESTS, rate_rps=RATE_RPS, seed=SEED, messages=True),
            "chat-sliding-window": multi_turn_chat(REQUESTS, rate_rps=RATE_RPS, seed=SEED,
                                                   window_tokens=DEFAULT_WINDOW_TOKENS, messages=True)}


@pytest.fixture(scope="module")
def access_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The gateways' access log (text lines, as ``serve`` writes them) in a file."""
    path = tmp_path_factory.mktemp("access") / "access.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    logger = logging.getLogger("kappa_gateway.access")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@pytest.fixture(scope="module")
def runs(traces: dict[str, list[TraceRequest]], access_log: Path) -> dict[str, Run]:
    whole = replay(traces["chat"])
    access_log.write_text("")  # keep the windowed run's lines only
    return {"chat": whole, "chat-sliding-window": replay(traces["chat-sliding-window"])}


def continuing(trace: list[TraceRequest]) -> list[bool]:
    """Per request: its conversation appeared earlier in the trace."""
    seen: set[str | None] = set()
    out = []
    for req in trace:
        out.append(req.session_id in seen)
        seen.add(req.session_id)
    return out


def test_append_only_chat_counts_no_invalidated_token(runs: dict[str, Run]) -> None:
    whole = runs["chat"]
    assert sum(whole.invalidated.values()) == 0 and whole.invalidations == 0
    assert sum(whole.cached_tokens) / sum(whole.prompt_tokens) > 0.8  # the whole history hits: the cache works


def test_sliding_window_loss_is_attributed_to_front_truncation(traces: dict[str, list[TraceRequest]],
                                                               runs: dict[str, Run]) -> None:
    whole, window = runs["chat"], runs["chat-sliding-window"]
    later = continuing(traces["chat"])
    assert later == continuing(traces["chat-sliding-window"]) and sum(later) >= REQUESTS // 2
    loss = sum((pw_s - kw_s) - (pw - kw) for pw, kw, pw_s, kw_s, c in zip(
        whole.prompt_tokens, whole.cached_tokens, window.prompt_tokens, window.cached_tokens, later) if c)
    counted = window.invalidated["front_truncation"]
    hit_whole = sum(whole.cached_tokens) / sum(whole.prompt_tokens)
    hit_window = sum(window.cached_tokens) / sum(window.prompt_tokens)
    share = counted / loss
    print(f"\nhit ratio whole {hit_whole:.3f}, window {hit_window:.3f}; re-prefill the window costs {loss:,} tokens, "
          f"front_truncation counted {counted:,.0f}: {share:.3f} of it")
    assert hit_window < hit_whole - 0.2  # the trap: the window's hit rate collapses
    assert 0.9 <= share <= 1.1, share
    assert sum(window.invalidated.values()) == counted  # nothing put down to another cause


def test_analyze_on_the_access_log_reports_the_counter(runs: dict[str, Run], access_log: Path) -> None:
    """The windowed run's access log, through ``analyze``'s reader: the same tokens by cause."""
    settings = parse_settings({"backends": [backend_doc("m", "http://127.0.0.1:1")]}, default_catalog(), env={})
    report = analyze_access_log(read_access_log(access_log), config_rows(settings, default_catalog()))
    window = runs["chat-sliding-window"]
    assert report["workload"]["requests"] == REQUESTS
    assert report["invalidation"]["by_cause"]["front_truncation"]["tokens"] == window.invalidated["front_truncation"]
    assert report["invalidation"]["by_cause"]["front_truncation"]["requests"] == window.invalidations


def test_route_explains_the_finding_without_recording_it(traces: dict[str, list[TraceRequest]]) -> None:
    """POST /v1/kappa/route shows a body's finding (cause, tokens, the conversation) and records nothing:
    the real request after it gets the same finding, counted once."""
    last: dict[str | None, TraceRequest] = {}
    pairs = []  # (a turn, the next turn of its conversation), where the window moved between them
    for req in traces["chat-sliding-window"]:
        before = last.get(req.session_id)
        if before is not None and before.messages[-1] in req.messages and req.messages[1] != before.messages[1]:
            pairs.append((before, req))
        last[req.session_id] = req
    earlier, moved = pairs[0]
    with run_mocks(1) as urls, run_gateway([backend_doc("m", urls[0])]) as gw:
        poll(lambda: gw.http.get("/ready").status_code == 200, "gateway ready")
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            client.chat.completions.create(model=MOCK_MODEL, messages=list(earlier.messages), max_tokens=1)
            body = {"model": MOCK_MODEL, "messages": list(moved.messages)}
            explained = [gw.http.post("/v1/kappa/route", json=body).json()["invalidation"] for _ in range(2)]
            assert explained[0] == explained[1] and explained[0]["cause"] == "front_truncation"
            assert explained[0]["conversation"] == 1 and explained[0]["invalidated_tokens"] > 0
            assert explained[0]["earlier_messages"] == len(earlier.messages)
            assert gw.metric("gateway_prefix_invalidated_tokens_total") == 0
            client.chat.completions.create(model=MOCK_MODEL, messages=list(moved.messages), max_tokens=1)
        assert gw.metric("gateway_prefix_invalidated_tokens_total", cause="front_truncation") == pytest.approx(
            explained[0]["invalidated_tokens"], rel=0.02)  # the same bytes, at a bytes/token now calibrated
        assert gw.metric("gateway_prefix_invalidations_total", cause="front_truncation") == 1
        completion = gw.http.post("/v1/kappa/route", json={"model": MOCK_MODEL, "prompt": "x"}).json()
        assert completion["invalidation"] is None
