"""Issue 16's kind: valid JSON nested ~1,000 levels deep where the gateway canonicalises.

Before the fix, ``tools``, ``chat_template_kwargs``, a message's ``tool_calls`` or a content
part nested 1,000 levels deep (orjson parses up to 1,024) raised `RecursionError` in
``json.dumps``: a 500 on the chat route, and on ``/v1/kappa/route`` a plain-text 500 after
which the keep-alive connection was closed. Now the body is relayed with load-only routing
(counted), the explanation says so, and one connection serves every request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import orjson
import pytest

from tests.integration.gateway_support import MOCK_MODEL, Gateway, backend_doc, poll, run_gateway, run_mocks
from tests.support.keepalive import OneConnection, is_openai_error

pytestmark = pytest.mark.integration

LEVELS = 1_000  # past json.dumps' recursion limit (1,000 frames), within orjson's 1,024
DEEP_LIST = "[" * LEVELS + "1" + "]" * LEVELS
DEEP_OBJECT = '{"a":' * LEVELS + "{}" + "}" * LEVELS
USER = '{"role": "user", "content": "hi"}'
KINDS = {
    "tools": f'"messages": [{USER}], "tools": [{{"type": "function", "function": '
             f'{{"name": "f", "parameters": {DEEP_OBJECT}}}}}]',
    "chat_template_kwargs": f'"messages": [{USER}], "chat_template_kwargs": {{"k": {DEEP_LIST}}}',
    "tool_calls": f'"messages": [{{"role": "assistant", "content": null, "tool_calls": {DEEP_LIST}}}, {USER}]',
    "content_part": f'"messages": [{{"role": "user", "content": '
                    f'[{{"type": "image_url", "image_url": {DEEP_OBJECT}}}]}}]',
}
VALID_CHAT = json.dumps({"model": MOCK_MODEL, "messages": [{"role": "user", "content": "next"}], "max_tokens": 1}).encode()


def body(kind: str) -> bytes:
    return f'{{"model": "{MOCK_MODEL}", "max_tokens": 1, {KINDS[kind]}}}'.encode()


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with run_mocks(2) as urls, run_gateway([backend_doc("a", urls[0]), backend_doc("b", urls[1], "b200")]) as g:
        poll(lambda: g.http.get("/ready").status_code == 200, "gateway ready")
        yield g


def test_the_bodies_are_json_the_gateway_parses() -> None:
    for kind in KINDS:
        assert orjson.loads(body(kind))["model"] == MOCK_MODEL


@pytest.mark.parametrize("kind", KINDS)
def test_a_deep_body_is_relayed_on_load_alone_and_the_connection_kept(gw: Gateway, kind: str) -> None:
    before = gw.metric("gateway_load_only_requests_total", reason="nesting_too_deep")
    conn = OneConnection(gw.url)
    try:
        answer = conn.post("/v1/chat/completions", body(kind))
        # Relayed: the backend answered (the mock, like vLLM's Python JSON parser, refuses
        # nesting this deep with a 400 in vLLM's error body); nothing of the gateway's own.
        assert answer.relayed and answer.status < 500 and (answer.status == 200 or is_openai_error(answer)), answer
        assert conn.post("/v1/chat/completions", VALID_CHAT).status == 200  # the same connection
    finally:
        conn.close()
    assert gw.metric("gateway_load_only_requests_total", reason="nesting_too_deep") == before + 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_explain_route_says_load_only_and_keeps_the_connection(gw: Gateway, kind: str) -> None:
    before = gw.metric("gateway_load_only_requests_total", reason="nesting_too_deep")
    conn = OneConnection(gw.url)
    try:
        answer = conn.post("/v1/kappa/route", body(kind))
        assert answer.status == 200, answer
        explained = json.loads(answer.body)
        assert explained["load_only_reason"] == "nesting_too_deep" and explained["prompt_blocks"] == 0
        assert all(c["cached_hbm_tokens"] + c["cached_host_tokens"] == 0 for c in explained["candidates"])
        again = conn.post("/v1/kappa/route", VALID_CHAT)  # the same connection
        assert again.status == 200 and json.loads(again.body)["load_only_reason"] is None
    finally:
        conn.close()
    assert gw.metric("gateway_load_only_requests_total", reason="nesting_too_deep") == before  # dry run: not counted
