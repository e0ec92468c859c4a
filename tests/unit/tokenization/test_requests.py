"""request_token_ids takes vLLM's steps (chat_utils.py, serving_chat.py, serving_completion.py), checked
on the shipped tokenizer, whose byte-level decode shows the exact text the template rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenization import EngineTokenizer, request_token_ids
from tokenization.requests import engine_messages, engine_tools

SHIPPED = Path(__file__).resolve().parents[3] / "assets" / "tokenizers" / "kappa-mock-bpe"
TOK = EngineTokenizer.from_dir(SHIPPED)
BOS = 1
NESTED: dict = {}
_inner = NESTED
for _ in range(5_000):  # deeper than Python's recursion limit: json.dumps in tojson cannot print it
    _inner["a"] = {}
    _inner = _inner["a"]


def chat_text(**body) -> str:
    return TOK.decode(request_token_ids(TOK, body, chat=True))


def test_text_parts_join_with_newlines_and_null_text_parts_are_skipped() -> None:
    content = [{"type": "text", "text": "one"}, {"type": "text", "text": None}, "two",
               {"type": "refusal", "refusal": "three"}, {"type": "input_text", "text": "four"}]
    assert engine_messages([{"role": "user", "content": content}]) == [{"role": "user",
                                                                        "content": "one\ntwo\nthree\nfour"}]
    assert chat_text(messages=[{"role": "user", "content": content}]) == \
        "<|bos|><|user|>\none\ntwo\nthree\nfour\n<|assistant|>\n"


def test_null_content_is_empty_and_only_the_engines_fields_reach_the_template() -> None:
    messages = [{"role": "assistant", "content": None, "extra": 1, "name": "bot", "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "c9", "name": 7},
                {"role": "developer", "content": "d"}]
    assert engine_messages(messages) == [{"role": "assistant", "content": "", "name": "bot"},
                                         {"role": "tool", "content": "42", "tool_call_id": "c9"},
                                         {"role": "developer", "content": "d", "tools": None}]


def test_tool_call_arguments_become_objects_as_vllm_hands_them_to_templates() -> None:
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "é"]}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"id": "c", "type": "function", "function": {"name": "h"}}]
    [message] = engine_messages([{"role": "assistant", "content": "ok", "tool_calls": calls}])
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [{"x": [1, "é"]}, {}, {}]
    text = chat_text(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok",
                                                                   "tool_calls": calls[:1]}])
    assert text == ('<|bos|><|user|>\nq\n<|assistant|>\nok[{"function":{"arguments":{"x":[1,"é"]},"name":"f"},'
                    '"id":"a","type":"function"}]\n<|assistant|>\n')


def test_tools_take_vllms_model_shape_with_null_description_and_parameters() -> None:
    tools = [{"type": "function", "function": {"name": "f"}},
             {"function": {"name": "g", "description": "G", "parameters": {"type": "object"}, "strict": True}}]
    assert engine_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "G", "parameters": {"type": "object"},
                                          "strict": True}}]
    assert chat_text(messages=[{"role": "user", "content": "q"}], tools=tools[:1]) == (
        '<|bos|><|tools|>\n[{"function":{"description":null,"name":"f","parameters":null},"type":"function"}]\n'
        "<|user|>\nq\n<|assistant|>\n")
    for bad in ([{"type": "custom", "custom": {}}], [{"function": {}}], {"f": 1}):
        with pytest.raises(ValueError):
            engine_tools(bad)


def test_generation_prompt_continuation_and_template_kwargs() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert chat_text(messages=messages[:1], add_generation_prompt=False) == "<|bos|><|user|>\nq\n"
    assert chat_text(messages=messages, add_generation_prompt=False, continue_final_message=True) == \
        "<|bos|><|user|>\nq\n<|assistant|>\nThe answer is"
    assert chat_text(messages=messages[:1], chat_template_kwargs={"add_generation_prompt": False}) == \
        "<|bos|><|user|>\nq\n"
    with pytest.raises(ValueError, match="not compatible"):
        chat_text(messages=messages, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set chat_template"):
        chat_text(messages=messages, chat_template_kwargs={"chat_template": "{{ 1 }}"})
    # Variables the template does not read change nothing, whatever their names.
    assert chat_text(messages=messages[:1], chat_template_kwargs={"self": 1, "variables": 2, "enable_thinking": False}) \
        == "<|bos|><|user|>\nq\n<|assistant|>\n"


def test_chat_adds_no_special_tokens_unless_asked() -> None:
    plain = request_token_ids(TOK, {"messages": [{"role": "user", "content": "q"}]}, chat=True)
    doubled = request_token_ids(TOK, {"messages": [{"role": "user", "content": "q"}], "add_special_tokens": True},
                                chat=True)
    assert plain[0] == BOS and plain[1] != BOS
    assert doubled == [BOS, *plain]  # vLLM: special tokens on top of what the template writes


@pytest.mark.parametrize("prompt", ["Hello world", ["Hello world"]])
def test_a_completion_string_gets_bos(prompt) -> None:
    assert request_token_ids(TOK, {"prompt": prompt}, chat=False) == [BOS, 9381, 4751, 734]
    assert request_token_ids(TOK, {"prompt": prompt, "add_special_tokens": False}, chat=False) == [9381, 4751, 734]


@pytest.mark.parametrize("prompt", [[5, 15999, 0], [[5, 15999, 0]]])
def test_completion_token_ids_pass_through_unchanged(prompt) -> None:
    assert request_token_ids(TOK, {"prompt": prompt}, chat=False) == [5, 15999, 0]


@pytest.mark.parametrize(("body", "match"), [
    ({"prompt": ["a", "b"]}, "batch of 2"),
    ({"prompt": [[1], [2]]}, "batch of 2"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": [1, True]}, "prompt must be"),
    ({"prompt": 3}, "prompt must be"),
    ({"prompt": [32000]}, "Token id 32000 is out of vocabulary"),
    ({"prompt": [-1]}, "Token id -1 is out of vocabulary"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens must be a boolean"),
])
def test_completion_bodies_that_have_no_single_token_sequence_are_refused(body, match) -> None:
    with pytest.raises(ValueError, match=match):
        request_token_ids(TOK, body, chat=False)


@pytest.mark.parametrize(("body", "match"), [
    ({"messages": []}, "non-empty list"),
    ({}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "string role"),
    ({"messages": [{"role": "user", "content": 3}]}, "message content must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'image_url' is not text"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}]}, "function object"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "must be an object"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "[" * 100_000}}]}]}, "nested too deeply"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": NESTED}}]}, "could not be rendered: RecursionError"),
])
def test_chat_bodies_it_cannot_tokenise_are_refused(body, match) -> None:
    with pytest.raises(ValueError, match=match):
        request_token_ids(TOK, body, chat=True)
    with pytest.raises(ValueError, match="JSON object"):
        request_token_ids(TOK, [body], chat=True)  # type: ignore[arg-type]
