"""The mock backend's own deterministic tokenizer and chat template.

Independent of the gateway's byte estimate (DESIGN.md §5): the gateway predicts token
counts from bytes, the mock counts them here, so a gateway tuned on the mock meets the same
kind of estimation error it meets on vLLM.

Pieces (a GPT-2/Llama-3-like pre-tokenizer, without the learned merges):

* each CJK ideograph, Hiragana, Katakana or Hangul character, and each emoji, is one piece
  (about one token per CJK character, as Llama 3 and Qwen give);
* letters form word pieces with at most one leading space (``" word"``); a word longer than
  `MAX_WORD_PIECE_LETTERS` letters is cut into chunks of that many (the space rides on the
  first);
* digits form pieces of up to three; runs of punctuation and of whitespace are pieces, cut
  into chunks of `MAX_OTHER_PIECE_CHARS`.

English prose comes out at about 4 characters per token (Llama 3: 4.2; the chunk lengths
were tuned to that on prose, see ``tests/unit/mock_vllm/test_tokenizer.py``). A piece's id is
``RESERVED_IDS + xxh32(piece) mod (VOCAB_SIZE − RESERVED_IDS)``: stable across processes and
machines, so traces replay to the same ids.

Chat template (ChatML-like; documented here as vLLM would read it from
``tokenizer_config.json``)::

    <|tools|>\\n{tools as canonical JSON}\\n          only when tools are given
    <|system|>\\n{content}\\n                         one block per message, in order
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}{tool_calls as canonical JSON}\\n
    <|assistant|>\\n                                  the generation prompt

The ``<|role|>\\n`` headers are special tokens. `encode` splits its input at them and
tokenises the text between headers on its own, so the tokens of a conversation's earlier
turns are always a prefix of the longer conversation's tokens and the prefix cache hits on
multi-turn chats. List-of-parts content joins its text parts; an image becomes
``<image:{first 16 hex of xxh64(url or data)}>`` so different images differ.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

VOCAB_SIZE = 128_000
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "tools")
# Ids 0..RESERVED_IDS-1 are special: 0 pad, 1 bos, 2 eos, then one role header per role.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS: dict[str, int] = {f"<|{role}|>\n": 3 + i for i, role in enumerate(ROLES)}
RESERVED_IDS = 256
MAX_WORD_PIECE_LETTERS = 6  # ≈ 4.1 chars/token on English prose (5: 3.9, 4: 3.4)
MAX_OTHER_PIECE_CHARS = 4
MAX_DIGITS_PER_PIECE = 3
GENERATION_PROMPT = "<|assistant|>\n"
IMAGE_HASH_HEX_CHARS = 16

_SINGLE = (
    "\u3040-\u30ff"  # Hiragana, Katakana
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # CJK ideographs (ext. A, unified, compatibility)
    "\uac00-\ud7af"  # Hangul syllables
    "\u2600-\u27bf"  # misc symbols, dingbats
    "\U0001f000-\U0001faff"  # emoji
    "\U00020000-\U0002fa1f"  # CJK ideographs ext. B+
)
_PIECE = re.compile(
    rf"[{_SINGLE}]"
    rf"| ?[^\W\d_{_SINGLE}]+"
    rf"| ?\d{{1,{MAX_DIGITS_PER_PIECE}}}"
    rf"| ?[^\s\w{_SINGLE}]+"
    r"|\s+(?!\S)|\s+"
)
_WORD = re.compile(rf" ?[^\W\d_{_SINGLE}]+")
_SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# Syllables for `token_text`: 8 consonant-vowel pairs per row, 64 in all.
_SYLLABLES = tuple(c + v for c in "bdfklmnprstvz"[:8] for v in "aeioulyw"[:8])


def pieces(text: str) -> list[str]:
    """Split text without special tokens into pieces (module docstring)."""
    out: list[str] = []
    for match in _PIECE.finditer(text):
        piece = match.group()
        if _WORD.fullmatch(piece):
            lead = 1 if piece[0] == " " else 0
            step = MAX_WORD_PIECE_LETTERS
            out.append(piece[: lead + step])
            out.extend(piece[i : i + step] for i in range(lead + step, len(piece), step))
        else:
            step = MAX_OTHER_PIECE_CHARS
            out.extend(piece[i : i + step] for i in range(0, len(piece), step))
    return out


def piece_id(piece: str) -> int:
    """The stable token id of one piece, in [RESERVED_IDS, VOCAB_SIZE)."""
    return RESERVED_IDS + xxhash.xxh32_intdigest(piece.encode("utf-8")) % (VOCAB_SIZE - RESERVED_IDS)


def encode(text: str) -> list[int]:
    """Token ids of ``text``; role headers (`SPECIAL_TOKENS`) map to their reserved ids.

    Returns:
        A list of ints in [0, VOCAB_SIZE); empty for an empty string. No BOS is added.
    """
    ids: list[int] = []
    for segment in _SPECIAL.split(text):
        special = SPECIAL_TOKENS.get(segment)
        if special is not None:
            ids.append(special)
        elif segment:
            ids.extend(piece_id(p) for p in pieces(segment))
    return ids


def count_tokens(text: str) -> int:
    """``len(encode(text))``, the prompt length the engine will see for a raw completion."""
    return len(encode(text))


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _media_placeholder(kind: str, payload: Any) -> str:
    digest = xxhash.xxh64_hexdigest(_canonical_json(payload).encode("utf-8"))
    return f"<{kind}:{digest[:IMAGE_HASH_HEX_CHARS]}>"


def _part_text(part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        return _media_placeholder("image", url)
    if kind == "input_audio":
        return _media_placeholder("audio", part.get("input_audio"))
    return _media_placeholder(str(kind), part)


def content_text(content: str | Iterable[Mapping[str, Any]] | None) -> str:
    """A message's content as template text: strings as given, parts joined (module docstring)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_part_text(part) for part in content)


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """Render a chat as prompt text with the generation prompt appended (module docstring).

    Args:
        messages: OpenAI-style messages: ``role`` and ``content`` (str, list of parts or
            None); assistant ``tool_calls`` are appended as canonical JSON.
        tools: the request's tool definitions, rendered first as canonical JSON.

    Returns:
        The prompt text; `encode` turns it into the engine's prompt ids.
    """
    blocks: list[str] = []
    if tools:
        blocks.append(f"<|tools|>\n{_canonical_json(list(tools))}\n")
    for message in messages:
        role = str(message.get("role", "user"))
        header = f"<|{role}|>\n"
        if header not in SPECIAL_TOKENS:  # an unknown role speaks as a user, named in the text
            header = f"<|user|>\n{role}: "
        body = content_text(message.get("content"))
        if message.get("tool_calls"):
            body += _canonical_json(message["tool_calls"])
        blocks.append(f"{header}{body}\n")
    blocks.append(GENERATION_PROMPT)
    return "".join(blocks)


def token_text(token_id: int) -> str:
    """Deterministic text for a generated id: a space and one or two syllables (≈ 5 chars)."""
    n = len(_SYLLABLES)
    first, second = token_id % n, (token_id // n) % (n + 1)
    return " " + _SYLLABLES[first] + (_SYLLABLES[second] if second < n else "")
