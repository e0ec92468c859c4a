"""Canonical bytes: what must change them, what must not, and what is rejected."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from prefix_index import (
    CanonicalizationError,
    NestingTooDeep,
    cache_salt,
    chat_canonical_bytes,
    completion_canonical_bytes,
    completion_prompts,
)

Body = dict[str, Any]

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
PNG_A = "data:image/png;base64," + "A" * 64
PNG_B = "data:image/png;base64," + "B" * 64


def chat(*messages: dict[str, Any], **fields: Any) -> Body:
    return {"model": "m", "messages": list(messages), **fields}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


SYSTEM = {"role": "system", "content": "You are terse."}
BASE = chat(SYSTEM, user("Hello"), tools=[TOOL])


def with_fields(**fields: Any) -> Body:
    body = copy.deepcopy(BASE)
    body.update(fields)
    return body


def reversed_keys(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(v) for v in value]
    return value


SAME = [
    pytest.param(BASE, reversed_keys(BASE), id="key-order"),
    pytest.param(
        BASE,
        with_fields(temperature=0.2, top_p=0.9, max_tokens=7, seed=3, n=2, logprobs=True),
        id="sampling-params",
    ),
    pytest.param(BASE, with_fields(stream=True, stream_options={"include_usage": True}), id="stream"),
    pytest.param(BASE, with_fields(user="alice", priority=5, kv_transfer_params={"x": 1}), id="user-extras"),
    pytest.param(BASE, with_fields(model="other-model", cache_salt="s1"), id="model-and-salt-are-seeds"),
    pytest.param(
        chat(user("Hello")), chat(user([{"type": "text", "text": "Hello"}])), id="string-is-one-text-part"
    ),
    pytest.param(chat(user("Hi")), chat(user("Hi"), tools=[]), id="empty-tools-is-no-tools"),
    pytest.param(
        chat(user([image(PNG_A)])), chat(user([image(PNG_A, detail="high")])), id="image-detail-ignored"
    ),
    pytest.param(
        chat({"role": "assistant", "content": None, "tool_calls": []}),
        chat({"role": "assistant"}),
        id="null-content-and-empty-tool-calls",
    ),
]

DIFFERENT = [
    pytest.param(chat(user("Hello")), chat(user("Hello!")), id="text"),
    pytest.param(chat(user("Hello")), chat({"role": "assistant", "content": "Hello"}), id="role"),
    pytest.param(
        chat(user("Hello world")), chat(user([{"type": "text", "text": "Hello"}])), id="string-vs-parts"
    ),
    pytest.param(
        chat(user("Hello")),
        chat(user([{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}])),
        id="part-boundary",
    ),
    pytest.param(chat(user("ab"), user("c")), chat(user("a"), user("bc")), id="message-boundary"),
    pytest.param(chat(SYSTEM, user("x")), chat(user("x"), SYSTEM), id="message-order"),
    pytest.param(BASE, with_fields(tools=None), id="tools-present"),
    pytest.param(
        BASE,
        with_fields(tools=[{**TOOL, "function": {**TOOL["function"], "description": "Weather"}}]),
        id="tool-description",
    ),
    pytest.param(chat(user([image(PNG_A)])), chat(user([image(PNG_B)])), id="image-data"),
    pytest.param(
        chat(user([image(PNG_A), {"type": "text", "text": "what?"}])),
        chat(user([{"type": "text", "text": "what?"}, image(PNG_A)])),
        id="part-order",
    ),
    pytest.param(
        chat(user([{"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}])),
        chat(user([{"type": "input_audio", "input_audio": {"data": "UklG", "format": "mp3"}}])),
        id="audio-format",
    ),
    pytest.param(chat(user("x")), chat({**user("x"), "name": "bob"}), id="name"),
    pytest.param(
        chat({"role": "assistant", "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}),
        chat({"role": "assistant", "tool_calls": [{"id": "c1", "function": {"arguments": "{1}"}}]}),
        id="tool-call-arguments",
    ),
    pytest.param(
        chat({"role": "tool", "tool_call_id": "c1", "content": "42"}),
        chat({"role": "tool", "tool_call_id": "c2", "content": "42"}),
        id="tool-call-id",
    ),
    pytest.param(
        chat({"role": "assistant", "content": "4"}),
        chat({"role": "assistant", "content": "4", "reasoning_content": "2+2"}),
        id="reasoning-content",
    ),
    pytest.param(
        chat(user("x")),
        chat(user("x"), chat_template_kwargs={"enable_thinking": False}),
        id="chat-template-kwargs",
    ),
    pytest.param(
        # text that spells out separators must not forge a second message
        chat(user("a\x1euser\x1fcontent\x1dtext=b")),
        chat(user("a"), user("b")),
        id="escaped-separators",
    ),
]


@pytest.mark.parametrize(("a", "b"), SAME)
def test_chat_bytes_equal(a: Body, b: Body) -> None:
    assert chat_canonical_bytes(a) == chat_canonical_bytes(b)


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_chat_bytes_differ(a: Body, b: Body) -> None:
    assert chat_canonical_bytes(a) != chat_canonical_bytes(b)


def test_a_conversation_extends_its_own_bytes() -> None:
    first = chat(SYSTEM, user("Hello"))
    later = chat(SYSTEM, user("Hello"), {"role": "assistant", "content": "Hi."}, user("Bye"))
    assert chat_canonical_bytes(later).startswith(chat_canonical_bytes(first))


def test_a_longer_text_shares_its_prefix() -> None:
    doc = "Long document. " * 50
    a = chat_canonical_bytes(chat(user(doc + "Question one?")))
    b = chat_canonical_bytes(chat(user(doc + "Question two?")))
    assert a[: len(doc)] == b[: len(doc)]


def test_image_data_is_digested_not_embedded() -> None:
    big = "data:image/png;base64," + "Q" * 100_000
    data = chat_canonical_bytes(chat(user([image(big), {"type": "text", "text": "describe"}])))
    assert len(data) < 200
    assert b"QQQQ" not in data


def test_output_is_utf8_with_non_ascii_text() -> None:
    data = chat_canonical_bytes(chat(user("héllo 世界 👋🏽 e\u0301"), tools=[TOOL]))
    assert "世界 👋🏽".encode() in data
    data.decode("utf-8")


COMPLETION_CASES = [
    pytest.param({"prompt": "Once upon"}, [b"Once upon"], id="string"),
    pytest.param({"prompt": ["a", "b"]}, [b"a", b"b"], id="batch-of-strings"),
    pytest.param({"prompt": [1, 22, 333]}, [b"\x1dtok:1,22,333,"], id="token-ids"),
    pytest.param({"prompt": [[1, 2], [3]]}, [b"\x1dtok:1,2,", b"\x1dtok:3,"], id="batch-of-token-ids"),
    pytest.param({"prompt": "\x1dtok:1,"}, [b"\x1b]tok:1,"], id="string-cannot-forge-tokens"),
]


@pytest.mark.parametrize(("body", "expected"), COMPLETION_CASES)
def test_completion_prompts(body: Body, expected: list[bytes]) -> None:
    assert completion_prompts(body) == expected
    assert completion_canonical_bytes(body) == expected[0]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param({"prompt": "1,2,3"}, {"prompt": [1, 2, 3]}, id="string-vs-token-ids"),
        pytest.param({"prompt": [1, 2, 3]}, {"prompt": [1, 2, 4]}, id="token-id"),
        pytest.param({"prompt": "Once"}, {"prompt": "once"}, id="text"),
    ],
)
def test_completion_bytes_differ(a: Body, b: Body) -> None:
    assert completion_canonical_bytes(a) != completion_canonical_bytes(b)


def test_completion_ignores_sampling_params_and_model() -> None:
    plain = {"model": "m", "prompt": "Once upon"}
    busy = {"prompt": "Once upon", "model": "n", "temperature": 0, "max_tokens": 9, "stream": True}
    assert completion_canonical_bytes(plain) == completion_canonical_bytes(busy)


def test_token_prompt_is_not_a_byte_prefix_of_a_longer_id() -> None:
    assert not completion_canonical_bytes({"prompt": [34]}).startswith(
        completion_canonical_bytes({"prompt": [3]})
    )


CHAT_ERRORS = [
    pytest.param(["m"], "request body must be an object, got list", id="body-list"),
    pytest.param({"model": "m"}, "messages must be a non-empty list, got null", id="no-messages"),
    pytest.param({"messages": {}}, "messages must be a non-empty list, got object", id="object"),
    pytest.param({"messages": []}, "messages must be a non-empty list, got an empty list", id="empty"),
    pytest.param(chat("hi"), "messages[0] must be an object, got str", id="message-str"),
    pytest.param(chat({"content": "x"}), "messages[0].role must be a string, got null", id="no-role"),
    pytest.param(
        chat(SYSTEM, user(42)),
        "messages[1].content must be a string, a list of parts or null, got int",
        id="content-int",
    ),
    pytest.param(chat(user({"text": "x"})), "messages[0].content must be", id="content-object"),
    pytest.param(
        chat(user([image(PNG_A), "x"])), "messages[0].content[1] must be an object", id="part-str"
    ),
    pytest.param(
        chat(user([{"text": "x"}])), "messages[0].content[0].type must be a string", id="part-no-type"
    ),
    pytest.param(
        chat(user([{"type": "text", "text": 5}])),
        "messages[0].content[0].text must be a string, got int",
        id="text-not-str",
    ),
    pytest.param(chat({**user("x"), "name": 7}), "messages[0].name must be a string", id="name-int"),
    pytest.param(chat(user("x"), tools={"a": 1}), "tools must be a list, got object", id="tools-object"),
]

COMPLETION_ERRORS = [
    pytest.param(
        {"model": "m"},
        "prompt must be a string, a list of strings or a list of token ids, got null",
        id="no-prompt",
    ),
    pytest.param({"prompt": {"text": "x"}}, "prompt must be a string", id="prompt-object"),
    pytest.param({"prompt": 1.5}, "got float", id="prompt-float"),
    pytest.param({"prompt": []}, "prompt must not be an empty list", id="prompt-empty"),
    pytest.param({"prompt": [1, True]}, "prompt[1] must be a string, a token id", id="token-bool"),
    pytest.param({"prompt": [True]}, "prompt[0] must be", id="only-bool"),
    pytest.param({"prompt": [1, "a"]}, "prompt[1]", id="mixed"),
    pytest.param(
        {"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1] must be a token id (int), got str", id="nested-str"
    ),
    pytest.param({"prompt": [[1], []]}, "prompt[1] must not be an empty list", id="nested-empty"),
    pytest.param(
        {"prompt": [5, -1]}, "prompt[1] must be a non-negative token id, got -1", id="negative-id"
    ),
]

SALT_ERRORS = [
    pytest.param({"cache_salt": ""}, "non-empty string if present, got an empty string", id="empty"),
    pytest.param({"cache_salt": 5}, "cache_salt must be a non-empty string if present, got int", id="int"),
    pytest.param({"cache_salt": ["a"]}, "cache_salt must be a non-empty string", id="list"),
]


@pytest.mark.parametrize(("body", "message"), CHAT_ERRORS)
def test_bad_chat_bodies_name_the_field(body: Any, message: str) -> None:
    with pytest.raises(CanonicalizationError, match=re.escape(message)):
        chat_canonical_bytes(body)


@pytest.mark.parametrize(("body", "message"), COMPLETION_ERRORS)
def test_bad_completion_prompts_name_the_field(body: Body, message: str) -> None:
    with pytest.raises(CanonicalizationError, match=re.escape(message)):
        completion_prompts(body)
    with pytest.raises(CanonicalizationError, match=re.escape(message)):
        completion_canonical_bytes(body)


@pytest.mark.parametrize(("body", "message"), SALT_ERRORS)
def test_bad_cache_salt_is_rejected(body: Body, message: str) -> None:
    with pytest.raises(CanonicalizationError, match=re.escape(message)):
        cache_salt(body)


def test_canonicalization_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        chat_canonical_bytes({"messages": 3})


# Nesting orjson parses (its limit is 1,024 levels) but json.dumps cannot encode (Python's
# recursion limit, 1,000 frames): issue 16's RecursionError.
TOO_DEEP_LEVELS = 1_000


def deep_list(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def deep_object(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels):
        value = {"a": value}
    return value


NESTED_TOO_DEEP = [
    pytest.param(chat(user("x"), tools=[{"type": "function", "function": {
        "name": "f", "parameters": deep_object(TOO_DEEP_LEVELS)}}]), "tools", id="tools"),
    pytest.param(chat(user("x"), chat_template_kwargs={"k": deep_list(TOO_DEEP_LEVELS)}), "chat_template_kwargs",
                 id="chat-template-kwargs"),
    pytest.param(chat({"role": "assistant", "content": None, "tool_calls": deep_list(TOO_DEEP_LEVELS)}, user("x")),
                 "messages[0].tool_calls", id="tool-calls"),
    pytest.param(chat(user([{"type": "image_url", "image_url": deep_object(TOO_DEEP_LEVELS)}])),
                 "messages[0].content[0]", id="content-part"),
]


@pytest.mark.parametrize(("body", "where"), NESTED_TOO_DEEP)
def test_nesting_past_the_encoder_raises_nesting_too_deep(body: Body, where: str) -> None:
    with pytest.raises(NestingTooDeep, match=re.escape(f"{where} is nested too deeply")) as info:
        chat_canonical_bytes(body)
    assert isinstance(info.value, CanonicalizationError)
    assert info.value.reason == "nesting_too_deep"


def test_deep_but_encodable_nesting_is_canonicalised() -> None:
    shallower = chat(user("x"), tools=[deep_list(100)])
    deeper = chat(user("x"), tools=[deep_list(101)])
    assert chat_canonical_bytes(shallower).startswith(b"\x1ctools=" + b"[" * 101 + b"1" + b"]" * 101)
    assert chat_canonical_bytes(shallower) != chat_canonical_bytes(deeper)


def test_a_token_id_too_long_to_write_out_is_a_canonicalization_error() -> None:
    with pytest.raises(CanonicalizationError, match=re.escape("prompt holds a token id too large to write out")):
        completion_prompts({"prompt": [1, 10**5000]})


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({}, None, id="absent"),
        pytest.param({"cache_salt": None}, None, id="null"),
        pytest.param({"cache_salt": "tenant-7"}, "tenant-7", id="string"),
    ],
)
def test_cache_salt(body: Body, expected: str | None) -> None:
    assert cache_salt(body) == expected
