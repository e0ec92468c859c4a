"""Canonical prompt bytes: what the prefix index hashes for a request.

This module owns the mapping from an OpenAI-compatible request body (``/v1/chat/completions``
or ``/v1/completions``) to UTF-8 bytes whose prefixes stand in for the engine's cached token
prefixes (DESIGN.md §4). The rule, from vLLM's automatic prefix caching (docs
"Automatic Prefix Caching"; ``vllm/v1/core/kv_cache_utils.py``):

- anything that changes what the engine caches changes the bytes: text, roles, names,
  tools, tool calls, media content (images, audio, video), the chat template and its
  kwargs, and the order of all of these;
- anything that does not, does not: sampling parameters (``temperature``, ``max_tokens``,
  ...), ``stream``/``stream_options``, ``user``, key order inside JSON objects, and
  ``model`` and ``cache_salt``, which seed the hash chain instead (``hashing.chain_seed``).

Chat layout, all text, request order::

    [FS chat_template=<json>] [FS chat_template_kwargs=<json>] [FS documents=<json>]
    [FS tools=<json>]
    RS <role> [US name=..] [US tool_call_id=..] [US reasoning_content=..] [US reasoning=..]
              [US content {GS text=<text> | GS refusal=<text> | GS <type>#<xxh3-128 hex>}]
              [US tool_calls=<json>]                                        (per message)

with FS/GS/RS/US the ASCII separators ``\\x1c``/``\\x1d``/``\\x1e``/``\\x1f``. Free text is
escaped (``\\x1b`` + a printable letter for each of ``\\x1b``-``\\x1f``), so no text can
forge a separator; escaping is applied piecewise, so a shared text prefix still gives a
shared byte prefix. JSON is ``json.dumps(sort_keys=True, separators=(",", ":"),
ensure_ascii=False)``, which already escapes control characters. Content given as a string
is the same as a single ``{"type": "text"}`` part. Non-text parts are represented by the
xxh3-128 hex digest of their URL or data, never by the data itself. Lone surrogates (which
JSON permits) are encoded with ``surrogatepass``, so encoding never fails.

Every failure is a `CanonicalizationError`: a malformed body (a field of the wrong type)
raises it directly; a well-formed value nested deeper than ``json.dumps`` can recurse
(Python's recursion limit, ~1,000 levels) raises its subclass `NestingTooDeep`, which
callers treat as "no prefix hashes for this body", not as the client's error.

Completions: a string prompt is its escaped text; a token-id prompt is
``GS "tok:" id "," id "," ...`` (the leading GS cannot occur in escaped text, and the
trailing comma keeps ``[3]`` from being a byte prefix of ``[34]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xxhash

from prefix_index.errors import CanonicalizationError, NestingTooDeep

__all__ = [
    "cache_salt",
    "chat_canonical_bytes",
    "completion_canonical_bytes",
    "completion_prompts",
]

SECTION = "\x1c"  # FS: request-level section (template, tools)
PART = "\x1d"  # GS: one content part; also marks a token-id prompt
MESSAGE = "\x1e"  # RS: starts a message
FIELD = "\x1f"  # US: starts a message field
ESCAPE = "\x1b"  # ESC: escapes any of the five reserved characters inside free text

_RESERVED = ESCAPE + SECTION + PART + MESSAGE + FIELD
_ESCAPE_TABLE = str.maketrans({c: ESCAPE + chr(ord(c) + 0x40) for c in _RESERVED})

# Request fields that vLLM feeds to the chat template, so they shape the rendered prompt.
_TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "documents")
# Optional string fields of a message, in the order they are emitted.
_MESSAGE_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content", "reasoning")
# Text-like part types -> (key holding the text, kind written to the bytes).
_TEXT_PARTS = {
    "text": ("text", "text"),
    "input_text": ("text", "text"),
    "output_text": ("text", "text"),
    "refusal": ("refusal", "refusal"),
}
_TOKEN_PROMPT_MARK = PART + "tok:"
_ENCODING_ERRORS = "surrogatepass"


def chat_canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """Return the canonical bytes of a chat-completions request.

    Args:
        body: the parsed JSON body of ``POST /v1/chat/completions``. Reads ``messages``
            (required, non-empty list), ``tools`` and the template fields
            ``chat_template``, ``chat_template_kwargs`` and ``documents``; every other
            field is ignored. Empty ``tools``/``tool_calls``/``chat_template_kwargs``
            count as absent (templates test them for truthiness).

    Returns:
        UTF-8 bytes (see the module docstring for the layout); equal bodies up to
        ignored fields and JSON key order give equal bytes.

    Raises:
        CanonicalizationError: the body is not an object, ``messages`` is missing, empty
            or not a list, a message is not an object or has no string ``role``, content
            is not a string, list of parts or null, a part has no string ``type``, or a
            field holds a value of the wrong type. The message names the field, e.g.
            ``messages[1].content[0].text``.
        NestingTooDeep: ``tools``, a template field, a message's ``tool_calls`` or a media
            part is nested too deeply to encode (a `CanonicalizationError` too).
    """
    body = _as_mapping(body, "request body")
    out: list[str] = []
    for field in _TEMPLATE_FIELDS:
        value = body.get(field)
        if value is not None and value != {} and value != []:
            out.append(f"{SECTION}{field}={_canonical_json(value, field)}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise CanonicalizationError(f"tools must be a list, got {_type_name(tools)}")
        if tools:
            out.append(f"{SECTION}tools={_canonical_json(tools, 'tools')}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else _type_name(messages)
        raise CanonicalizationError(f"messages must be a non-empty list, got {got}")
    for i, message in enumerate(messages):
        _append_message(out, message, f"messages[{i}]")
    return "".join(out).encode("utf-8", _ENCODING_ERRORS)


def completion_prompts(body: Mapping[str, Any]) -> list[bytes]:
    """Return one canonical byte string per prompt of a completions request.

    vLLM treats a list of strings, or a list of token-id lists, as a batch of independent
    prompts; each gets its own entry, in request order.

    Args:
        body: the parsed JSON body of ``POST /v1/completions``; only ``prompt`` is read.
            It may be a string, a list of strings, a list of token ids (non-negative
            ints; bools are rejected) or a list of such lists.

    Returns:
        A non-empty list of UTF-8 byte strings, one per prompt.

    Raises:
        CanonicalizationError: ``prompt`` is missing, of another type, an empty list, a
            list mixing kinds, or holds a token id that is not a non-negative int. The
            message names the field, e.g. ``prompt[1][3]``.
    """
    body = _as_mapping(body, "request body")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(_escape(prompt))]
    if not isinstance(prompt, list):
        raise CanonicalizationError(
            "prompt must be a string, a list of strings or a list of token ids, "
            f"got {_type_name(prompt)}"
        )
    if not prompt:
        raise CanonicalizationError("prompt must not be an empty list")
    kinds = set(map(type, prompt))
    if kinds == {str}:
        return [_encode(_escape(p)) for p in prompt]
    if kinds == {int}:
        return [_token_prompt(prompt, "prompt")]
    if kinds == {list}:
        return [_token_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    first = type(prompt[0])
    bad = next(i for i, p in enumerate(prompt) if type(p) is not first or first not in (str, int, list))
    raise CanonicalizationError(
        f"prompt[{bad}] must be a string, a token id (int) or a list of token ids like "
        f"the other items, got {_type_name(prompt[bad])}"
    )


def completion_canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """Return the canonical bytes of the first prompt of a completions request.

    Routing places a whole request on one backend, and for a batch the first prompt is
    the representative one; use :func:`completion_prompts` to see all of them.

    Args:
        body: the parsed JSON body of ``POST /v1/completions`` (see
            :func:`completion_prompts`).

    Returns:
        UTF-8 bytes of the first prompt.

    Raises:
        CanonicalizationError: as :func:`completion_prompts`.
    """
    return completion_prompts(body)[0]


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """Return the request's ``cache_salt``, which seeds the hash chain.

    Args:
        body: a parsed chat or completions request body.

    Returns:
        The salt string, or ``None`` when the field is absent or null.

    Raises:
        CanonicalizationError: ``cache_salt`` is present but not a non-empty string
            (vLLM rejects such requests too; REFERENCE.md §3).
    """
    body = _as_mapping(body, "request body")
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        got = "an empty string" if salt == "" else _type_name(salt)
        raise CanonicalizationError(f"cache_salt must be a non-empty string if present, got {got}")
    return salt


def _append_message(out: list[str], message: object, where: str) -> None:
    message = _as_mapping(message, where)
    role = message.get("role")
    if not isinstance(role, str):
        raise CanonicalizationError(f"{where}.role must be a string, got {_type_name(role)}")
    out.append(MESSAGE + _escape(role))
    for field in _MESSAGE_TEXT_FIELDS:
        value = message.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise CanonicalizationError(f"{where}.{field} must be a string, got {_type_name(value)}")
        out.append(f"{FIELD}{field}={_escape(value)}")
    content = message.get("content")
    # Long texts go in as their own list items: "".join copies them once, not twice.
    if isinstance(content, str):
        out += (f"{FIELD}content{PART}text=", _escape(content))
    elif isinstance(content, list):
        out.append(FIELD + "content")
        for j, part in enumerate(content):
            _append_part(out, part, f"{where}.content[{j}]")
    elif content is not None:
        raise CanonicalizationError(
            f"{where}.content must be a string, a list of parts or null, got {_type_name(content)}"
        )
    tool_calls = message.get("tool_calls")
    if tool_calls:
        out.append(f"{FIELD}tool_calls={_canonical_json(tool_calls, where + '.tool_calls')}")


def _append_part(out: list[str], part: object, where: str) -> None:
    """One content part: text-like parts verbatim, every other part as a digest."""
    part = _as_mapping(part, where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise CanonicalizationError(f"{where}.type must be a string, got {_type_name(kind)}")
    text_spec = _TEXT_PARTS.get(kind)
    if text_spec is not None:
        key, label = text_spec
        text = part.get(key)
        if not isinstance(text, str):
            raise CanonicalizationError(f"{where}.{key} must be a string, got {_type_name(text)}")
        out += (f"{PART}{label}=", _escape(text))
        return
    # Media and unknown parts: OpenAI puts the payload under a key named like the type
    # ({"type": "image_url", "image_url": {"url": ...}}); the Responses API's
    # input_image keeps its URL in "image_url". A URL (often a data: URL) is what the
    # engine's multi-modal hash depends on; "detail" and similar hints are not.
    payload = part.get(kind)
    if payload is None and kind == "input_image":
        payload = part.get("image_url", part.get("file_id"))
    if isinstance(payload, Mapping) and isinstance(payload.get("url"), str):
        ref = payload["url"]
    elif isinstance(payload, str):
        ref = payload
    else:
        ref = _canonical_json(part if payload is None else payload, where)
    digest = xxhash.xxh3_128_hexdigest(_encode(ref))
    out.append(f"{PART}{_escape(kind)}#{digest}")


def _token_prompt(ids: list[Any], where: str) -> bytes:
    if not ids:
        raise CanonicalizationError(f"{where} must not be an empty list of token ids")
    if set(map(type, ids)) != {int}:
        bad = next(i for i, t in enumerate(ids) if type(t) is not int)
        raise CanonicalizationError(
            f"{where}[{bad}] must be a token id (int), got {_type_name(ids[bad])}"
        )
    if min(ids) < 0:
        bad = next(i for i, t in enumerate(ids) if t < 0)
        raise CanonicalizationError(f"{where}[{bad}] must be a non-negative token id, got {ids[bad]}")
    try:
        digits = ",".join(map(str, ids))
    except ValueError:  # past sys.get_int_max_str_digits() (4,300): no JSON parser's int gets here
        raise CanonicalizationError(f"{where} holds a token id too large to write out") from None
    return (_TOKEN_PROMPT_MARK + digits + ",").encode("ascii")


def _escape(text: str) -> str:
    """Escape the reserved separators; the common case (none present) copies nothing."""
    for c in _RESERVED:
        if c in text:
            return text.translate(_ESCAPE_TABLE)
    return text


def _encode(text: str) -> bytes:
    return text.encode("utf-8", _ENCODING_ERRORS)


def _canonical_json(value: object, where: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:  # the encoder's depth, not the body, is at fault (NestingTooDeep)
        raise NestingTooDeep(f"{where} is nested too deeply to encode as canonical JSON") from None
    except (TypeError, ValueError) as exc:
        raise CanonicalizationError(f"{where} is not JSON-serialisable: {exc}") from exc


def _as_mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CanonicalizationError(f"{where} must be an object, got {_type_name(value)}")
    return value


def _type_name(value: object) -> str:
    """JSON-flavoured type name for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list):
        return "list"
    return type(value).__name__
