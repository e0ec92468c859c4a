"""The token ids a vLLM engine computes for an OpenAI request body.

One function, `request_token_ids`, used by both sides of the wire: the mock backend (as the
engine) and the gateway (to name the engine's KV blocks), so the two agree by construction.
A real vLLM engine takes the same steps through transformers:

Chat (``vllm/entrypoints/chat_utils.py::parse_chat_messages``, ``serving_chat.py``):

1. each message becomes the template's form: ``role``; ``content`` as one string (a string as
   given; a list of parts: the text of its ``text`` / ``input_text`` / ``output_text`` /
   ``refusal`` / ``thinking`` parts and its plain-string parts, joined with ``"\\n"``; parts whose
   text is null are skipped; ``None``: ``""``); an assistant's ``tool_calls`` (each call's
   ``function.arguments`` parsed from its JSON string into an object, ``{}`` when it is not
   valid JSON; an empty list dropped) and ``reasoning``; a tool message's ``tool_call_id``; a
   string ``name``; a developer message's ``tools``;
2. ``tools`` take vLLM's model shape (``ChatCompletionToolsParam`` in ``protocol.py``):
   ``{"type": "function", "function": {"name", "description", "parameters", ...}, ...}`` with
   ``description`` / ``parameters`` null when absent;
3. the template renders with ``add_generation_prompt`` (default true),
   ``continue_final_message`` (default false), ``documents`` and ``chat_template_kwargs``
   merged over them;
4. the text is encoded with ``add_special_tokens`` (default **false** for chat).

Completions (``serving_completion.py``): ``prompt`` as a string (encoded with
``add_special_tokens``, default **true**), a list of token ids (unchanged), or a batch of one
of either. Media parts (images, audio, video) are refused: these tokenizers serve text-only
models, and a text-only vLLM engine refuses them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenization.engine_tokenizer import EngineTokenizer

__all__ = ["request_token_ids", "engine_messages", "engine_tools"]

TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal", "thinking")
_TEXT_FIELD = {"refusal": "refusal", "thinking": "thinking"}  # other text parts keep it under "text"


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise ValueError(f"a content part must be an object or a string, got {type(part).__name__}")
    kind = part.get("type")
    if kind not in TEXT_PART_TYPES:
        raise ValueError(f"content part type {kind!r} is not text; a text-only model's tokenizer cannot "
                         "tokenise it")
    text = part.get(_TEXT_FIELD.get(kind, "text"))
    if text is not None and not isinstance(text, str):
        raise ValueError(f"a {kind} part's text must be a string")
    return text


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string, a list of parts or null, got {type(content).__name__}")
    return "\n".join(t for t in map(_part_text, content) if t is not None)


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
        raise ValueError("tool_calls must be a list of objects")
    out = []
    for call in calls:
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ValueError("each tool call needs a function object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
            except RecursionError:  # nested past Python's limit: vLLM's own json.loads fails the request
                raise ValueError("tool call arguments nested too deeply to parse") from None
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _engine_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError("each message must be an object with a string role")
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"))}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(message["tool_calls"])
            if not out["tool_calls"]:
                del out["tool_calls"]
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def engine_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages in the form vLLM hands the template (module docstring, step 1).

    Raises:
        ValueError: not a non-empty list of messages, a message without a string role, a media
            or unknown content part, or malformed ``tool_calls``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_engine_message(m) for m in messages]


def engine_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's ``tools`` in vLLM's model shape (module docstring, step 2); None stays None.

    Raises:
        ValueError: not a list of ``{"type": "function", "function": {"name": str, ...}}``.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                or tool.get("type", "function") != "function":
            raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        shaped = {"name": function["name"], "description": function.get("description"),
                  "parameters": function.get("parameters"), **function}
        out.append({"type": "function", **tool, "function": shaped})
    return out


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a boolean")
    return value


def _chat_ids(tok: EngineTokenizer, body: Mapping[str, Any]) -> list[int]:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ValueError("chat_template_kwargs must be an object")
    documents = body.get("documents")
    merged = {"continue_final_message": _flag(body, "continue_final_message", False),
              **({"documents": documents} if documents is not None else {}), **kwargs}
    text = tok.render_chat(engine_messages(body.get("messages")), engine_tools(body.get("tools")),
                           add_generation_prompt=_flag(body, "add_generation_prompt", True),
                           chat_template_kwargs=merged)
    return tok.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _single_prompt(prompt: Any) -> str | list[int]:
    """``prompt`` as one string or one list of ids (vLLM's ``prompt`` forms, a batch of one unwrapped)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
        return prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        raise ValueError(f"a batch of {len(prompt)} prompts has no single token sequence")
    raise ValueError("prompt must be a string, a non-empty list of token ids, or a batch of one of either")


def request_token_ids(tok: EngineTokenizer, body: Mapping[str, Any], *, chat: bool) -> list[int]:
    """The prompt token ids a vLLM engine serving ``tok``'s model computes for ``body``.

    The mock backend (as the engine) and the gateway both call this, so they agree by
    construction; a real vLLM engine takes the same steps through transformers'
    ``apply_chat_template`` and fast tokenizer (module docstring for each step and its source).

    Args:
        tok: the model's tokenizer (`EngineTokenizer.from_dir`).
        body: the parsed JSON body of ``/v1/chat/completions`` (``chat=True``: ``messages``,
            ``tools``, ``add_generation_prompt``, ``continue_final_message``,
            ``chat_template_kwargs``, ``documents``, ``add_special_tokens``) or
            ``/v1/completions`` (``chat=False``: ``prompt``, ``add_special_tokens``). Other
            fields are ignored.
        chat: which endpoint the body is for.

    Returns:
        The prompt's token ids, each in [0, ``tok.vocab_size``); ``len`` of it is the engine's
        ``usage.prompt_tokens``.

    Raises:
        ValueError: a body that cannot be tokenised (a malformed field, media content, a batch of
            several prompts, a template error, an id out of vocabulary). A caller that only
            estimates (the gateway's index) falls back to its approximate path; the mock answers 400.
    """
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    if chat:
        return _chat_ids(tok, body)
    add_special_tokens = _flag(body, "add_special_tokens", True)
    return tok.prompt_token_ids(_single_prompt(body.get("prompt")), add_special_tokens=add_special_tokens)
