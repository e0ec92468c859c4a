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
