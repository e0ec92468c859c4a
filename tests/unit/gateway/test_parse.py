"""What routing reads from a body: max_tokens (max_completion_tokens first on chat), stream, model."""

from __future__ import annotations

import orjson
import pytest

from fleet_config import default_catalog, parse_settings
from gateway.errors import BadRequest
from gateway.routing import DEFAULT_MAX_TOKENS_ESTIMATE
from tests.unit.gateway.routing_support import routing_service

SETTINGS = parse_settings({"backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b",
                                         "hardware": "h100-sxm"}]}, default_catalog(), env={})
CHAT = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "llama-3.1-8b", "prompt": "hi"}


@pytest.mark.parametrize(("kind", "body", "expected"), [
    # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; vLLM reads the latter first.
    ("chat", {**CHAT, "max_tokens": 100, "max_completion_tokens": 7}, 7),
    ("chat", {**CHAT, "max_completion_tokens": 7}, 7),
    ("chat", {**CHAT, "max_tokens": 100, "max_completion_tokens": None}, 100),
    ("chat", {**CHAT, "max_tokens": 100}, 100),
    ("chat", CHAT, DEFAULT_MAX_TOKENS_ESTIMATE),
    # The completions API has no max_completion_tokens: it is an unknown field there, passed through.
    ("completion", {**COMPLETION, "max_tokens": 100, "max_completion_tokens": 7}, 100),
], ids=["chat-both-completion-wins", "chat-completion-only", "chat-null-completion", "chat-max-tokens",
        "chat-neither", "completions-ignores-it"])
async def test_max_tokens_charged(kind: str, body: dict, expected: int) -> None:
    async with routing_service(SETTINGS) as routing:
        parsed = routing.parse(kind, orjson.dumps(body))
        assert parsed.max_tokens == expected
        plan = await routing.plan(parsed)
        assert plan.features.max_tokens == expected


async def test_a_bad_max_completion_tokens_is_named() -> None:
    async with routing_service(SETTINGS) as routing:
        with pytest.raises(BadRequest, match="'max_completion_tokens' must be a positive integer") as info:
            routing.parse("chat", orjson.dumps({**CHAT, "max_tokens": 5, "max_completion_tokens": 0}))
        assert info.value.param == "max_completion_tokens"


# Valid JSON orjson parses (≤ 1,024 levels) nested past what json.dumps can encode: issue 16.
DEEP_TOOLS = (b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "tools": ['
              + b'{"a":' * 1_000 + b"{}" + b"}" * 1_000 + b"]}")
LOAD_ONLY = "gateway_load_only_requests_total"


async def test_a_body_nested_too_deep_to_hash_is_routed_on_load_alone() -> None:
    async with routing_service(SETTINGS) as routing:
        parsed = routing.parse("chat", DEEP_TOOLS)
        assert (parsed.load_only_reason, parsed.hashes, parsed.prompt_bytes) == ("nesting_too_deep", [], len(DEEP_TOOLS))
        registry = routing.telemetry.registry
        await routing.plan(parsed, dry_run=True)  # the explain endpoint's: not counted
        assert registry.get_sample_value(LOAD_ONLY, {"reason": "nesting_too_deep"}) == 0
        plan = await routing.plan(parsed)
        assert registry.get_sample_value(LOAD_ONLY, {"reason": "nesting_too_deep"}) == 1
        assert all(c.cached_tokens == 0 for c in plan.decision.ranked)
        # Its length is the body's, not canonical prompt bytes: no bytes-per-token sample.
        routing.observe_usage(plan, plan.decision.chosen, {"prompt_tokens": len(DEEP_TOOLS) // 3})
        assert routing.dispatcher.calibration.samples.get("llama-3.1-8b", 0) == 0


async def test_a_malformed_body_is_still_refused() -> None:
    async with routing_service(SETTINGS) as routing:
        with pytest.raises(BadRequest, match=r"messages\[0\].role must be a string") as info:
            routing.parse("chat", orjson.dumps({**CHAT, "messages": [{"role": 5, "content": "x"}]}))
        assert info.value.param == "messages"
