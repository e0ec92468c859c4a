"""Hypothesis strategies for request bodies that try to make the gateway fail (issue 16).

Imports none of the project's packages (STYLE.md B2); the fuzz test
(``tests/edge/test_fuzz_bodies.py``) and ``bench/fuzz.py`` draw from `request_bodies` (and
`routed_bodies`, which draws the route too), which mixes, by weight:

- **structured** (6/10): an OpenAI-like chat or completions body, mostly of the route's kind
  (roles, text and media parts, tools, tool calls, template kwargs, stream options, cache
  salt, token-id prompts), then 0–3 structural mutations (a key deleted, a value replaced
  by a weird scalar, random JSON or a deep nest, a key added) and, one time in four, a
  mutation of its bytes (duplicate keys, NaN/Infinity, a lone surrogate, a number past a
  double, invalid UTF-8, a BOM, truncation, trailing garbage);
- **deep** (2/10): a valid body with a value nested 1–1,100 levels deep (lists or objects)
  in ``tools``, ``chat_template_kwargs``, a message's ``tool_calls``, a content part, the
  prompt, a sampling field, or the body itself — around the 1,000 levels where ``json.dumps``
  stops and orjson's 1,024 limit;
- **random JSON** (1/10): any JSON value, half the time an object naming the served model;
- **random bytes** (1/10).

Integers in generated values are small (−10…10) or far past any context (≥ 2**31), so a
mutated ``max_tokens`` never asks a mock for thousands of tokens.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

MODEL = "llama-3.1-8b"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/kappa/route")
# The structured bodies' own max_tokens: the mock answers them at once.
MAX_TOKENS_RANGE = (1, 4)
BIG_INTS = (2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**63) - 1)
WEIRD_SCALARS = (None, True, False, 0, -1, 1.5, -0.0, 1e308, 5e-324, "", "x", "\x00", "\u202e", "\U0001f642" * 3,
                 "\x1b\x1c\x1d\x1e\x1f", "   ", "null", [], {}, [[]], {"": None}, *BIG_INTS)
ROLES = ("user", "assistant", "system", "tool", "developer", "", "USER", "\U0001f642")
PART_TYPES = ("text", "image_url", "input_audio", "video_url", "input_text", "refusal", "file", "")
# Shallow, around json.dumps' limit (~1,000 less the stack) and orjson's (1,024), and fixed marks.
DEEP_LEVELS = st.one_of(st.integers(1, 64), st.integers(900, 1_100),
                        st.sampled_from((255, 256, 512, 1_023, 1_024, 1_025)))
# Byte-level edits of an encoded body (`_mutate_bytes`).
BYTE_MUTATIONS = ("duplicate-model", "nan", "infinity", "lone-surrogate", "huge-number", "invalid-utf8", "bom",
                  "truncate", "trailing-garbage", "empty", "whitespace", "null-byte")


@dataclass(frozen=True)
class Nested:
    """A value ``levels`` deep, written straight as JSON text (json.dumps would recurse)."""

    levels: int
    objects: bool  # {"a": {"a": ...}} rather than [[...]]
    leaf: str = "1"

    def text(self) -> str:
        if self.objects:
            return '{"a":' * self.levels + self.leaf + "}" * self.levels
        return "[" * self.levels + self.leaf + "]" * self.levels


def encode(value: Any) -> bytes:
    """``value`` as JSON bytes, `Nested` values written out as their text."""
    holes: list[str] = []
    tag = uuid.uuid4().hex

    def hole(obj: object) -> str:
        if not isinstance(obj, Nested):
            raise TypeError(f"cannot encode {type(obj).__name__}")
        holes.append(obj.text())
        return f"@{tag}:{len(holes) - 1}@"

    text = json.dumps(value, default=hole)
    for i, filling in enumerate(holes):
        text = text.replace(f'"@{tag}:{i}@"', filling, 1)
    return text.encode("utf-8", "surrogatepass")


# -- values -------------------------------------------------------------------------------
short_text = st.text(max_size=24)
small_ints = st.integers(-10, 10)
scalars = st.one_of(st.none(), st.booleans(), small_ints, st.sampled_from(BIG_INTS),
                    st.floats(allow_nan=False, allow_infinity=False), short_text)
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(short_text, kids, max_size=4)),
                           max_leaves=12)
nested = st.builds(Nested, levels=DEEP_LEVELS, objects=st.booleans())
weird = st.one_of(st.sampled_from(WEIRD_SCALARS).map(copy.deepcopy), json_values, nested)  # fresh [] and {}


@st.composite
def content_part(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(PART_TYPES))
    if kind in ("text", "input_text"):
        return {"type": kind, "text": draw(short_text)}
    if kind == "refusal":
        return {"type": kind, "refusal": draw(short_text)}
    if kind == "input_audio":
        return {"type": kind, "input_audio": {"data": draw(short_text), "format": "wav"}}
    return {"type": kind, kind or "x": {"url": "data:image/png;base64," + draw(short_text)}}


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": draw(st.sampled_from(ROLES))}
    out["content"] = draw(st.one_of(short_text, st.lists(content_part(), max_size=3), st.none()))
    if draw(st.integers(0, 5)) == 0:
        out["tool_calls"] = [{"id": "call_1", "type": "function",
                              "function": {"name": draw(short_text), "arguments": draw(short_text)}}]
    if draw(st.integers(0, 5)) == 0:
        out["name"] = draw(short_text)
    return out


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "a tool",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": draw(st.lists(message(), min_size=1, max_size=3)),
                            "max_tokens": draw(st.integers(*MAX_TOKENS_RANGE))}
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.integers(0, 3)) == 0:
        body["tools"] = [tool(draw(short_text))]
    if draw(st.integers(0, 5)) == 0:
        body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
    if draw(st.integers(0, 5)) == 0:
        body["cache_salt"] = draw(short_text)
    return body


@st.composite
def completion_body(draw: st.DrawFn) -> dict[str, Any]:
    token_ids = st.lists(st.integers(0, 1_000), min_size=1, max_size=8)
    prompt = draw(st.one_of(short_text, token_ids, st.lists(token_ids, min_size=1, max_size=2),
                            st.lists(short_text, min_size=1, max_size=2)))
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": draw(st.integers(*MAX_TOKENS_RANGE))}
    if draw(st.booleans()):
        body["stream"] = True
    return body


# -- mutations ----------------------------------------------------------------------------
def _slots(body: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``body``, breadth first."""
    out: list[tuple[Any, Any]] = []
    queue = [body]
    while queue:
        node = queue.pop(0)
        keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        for key in keys:
            out.append((node, key))
            queue.append(node[key])
    return out


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` after 0–3 structural edits."""
    for _ in range(draw(st.integers(0, 3))):
        slots = _slots(body)
        edit = draw(st.sampled_from(("delete", "replace", "replace", "add")))
        if edit == "add" or not slots:
            targets = [body] + [c[k] for c, k in slots if isinstance(c[k], dict)]
            target = targets[draw(st.integers(0, len(targets) - 1))]
            target[draw(st.one_of(st.sampled_from(("n", "stream", "stream_options", "max_completion_tokens",
                                                   "cache_salt", "tools", "prompt", "messages")), short_text))] = \
                draw(weird)
            continue
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        if edit == "delete":
            del container[key]
        else:
            container[key] = draw(weird)
    return body


def _mutate_bytes(raw: bytes, edit: str, cut: int) -> bytes:
    """One byte-level edit (`BYTE_MUTATIONS`); ``cut`` picks a position where one is needed."""
    head, rest = (raw[:1], raw[1:]) if raw.startswith(b"{") else (b"{", raw + b"}")
    inserts = {
        "duplicate-model": b'"model": "other-model", ',
        "nan": b'"temperature": NaN, ',
        "infinity": b'"top_p": -Infinity, ',
        "lone-surrogate": b'"user": "\\ud800", ',
        "huge-number": b'"seed": 1e400, ',
        "invalid-utf8": b'"user": "\xff\xfe", ',
        "null-byte": b'"user": "a\x00b", ',
    }
    if edit in inserts:
        return head + inserts[edit] + rest
    if edit == "bom":
        return b"\xef\xbb\xbf" + raw
    if edit == "truncate":
        return raw[: cut % max(len(raw), 1)]
    if edit == "trailing-garbage":
        return raw + b"} x"
    if edit == "empty":
        return b""
    return b" \r\n\t" + raw + b"\n "  # whitespace


@st.composite
def structured_bodies(draw: st.DrawFn, route: str | None = None) -> bytes:
    """A chat or completions body, mostly of the route's own kind (4 in 5), mutated."""
    own = {"/v1/chat/completions": chat_body(), "/v1/completions": completion_body()}.get(route)
    kinds = [own] * 4 + [chat_body(), completion_body()] if own is not None else [chat_body(), completion_body()]
    body = draw(mutated(draw(st.one_of(*kinds))))
    raw = encode(body)
    if draw(st.integers(0, 3)) == 0:
        raw = _mutate_bytes(raw, draw(st.sampled_from(BYTE_MUTATIONS)), draw(st.integers(0, 10_000)))
    return raw


@st.composite
def deep_bodies(draw: st.DrawFn) -> bytes:
    deep = draw(nested)
    where = draw(st.sampled_from(("tools", "chat_template_kwargs", "tool_calls", "content_part", "prompt",
                                  "temperature", "stream_options", "body")))
    if where == "body":
        return ("[" * deep.levels + "]" * deep.levels).encode() if not deep.objects else encode(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": deep})
    body = draw(completion_body()) if where == "prompt" else draw(chat_body())
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    elif where == "chat_template_kwargs":
        body["chat_template_kwargs"] = {"k": deep}
    elif where == "tool_calls":
        body["messages"].insert(0, {"role": "assistant", "content": None, "tool_calls": deep})
    elif where == "content_part":
        body["messages"][0]["content"] = [{"type": "image_url", "image_url": deep}]
    elif where == "prompt":
        body["prompt"] = Nested(deep.levels, objects=False, leaf="[1, 2]")
    else:
        body[where] = deep
    return encode(body)


@st.composite
def random_json_bodies(draw: st.DrawFn) -> bytes:
    value = draw(json_values)
    if draw(st.booleans()):
        value = {"model": MODEL, **(value if isinstance(value, dict) else {"messages": value})}
    return encode(value)


def request_bodies(route: str | None = None) -> st.SearchStrategy[bytes]:
    """Request bodies as bytes, mixed as the module docstring says; structured ones mostly of
    ``route``'s kind (chat for ``/v1/chat/completions``, completions for ``/v1/completions``)."""
    return st.one_of(*[structured_bodies(route)] * 6, *[deep_bodies()] * 2, random_json_bodies(),
                     st.binary(max_size=256))


def routed_bodies() -> st.SearchStrategy[tuple[str, bytes]]:
    """(route, body) pairs over `ROUTES`, each body drawn by ``request_bodies(route)``."""
    return st.sampled_from(ROUTES).flatmap(lambda route: st.tuples(st.just(route), request_bodies(route)))
