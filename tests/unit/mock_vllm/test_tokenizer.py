"""The mock's tokenizer: token density, determinism, and a chat template whose turns are prefixes."""

from __future__ import annotations

import pytest

from mock_vllm import tokenizer as tok

PROSE = {
    "physics": (
        "In the beginning of the twentieth century, physicists discovered that light behaves both as a "
        "wave and as a particle, a finding that transformed our understanding of nature. Researchers "
        "continue to study these phenomena, publishing thousands of papers every year on quantum "
        "mechanics, relativity, and cosmology. It's remarkable how much we've learned, yet how much "
        "remains unknown."
    ),
    "story": (
        "The old lighthouse keeper climbed the spiral staircase every evening at dusk. He trimmed the "
        "wick, polished the great lens, and watched the ships pass along the rocky coast. Nobody in the "
        "village remembered when he had arrived, but everyone agreed that the harbour had never been safer."
    ),
    "instructions": (
        "To replace the filter, first switch off the unit and unplug it from the wall. Open the front "
        "panel by pressing both tabs, slide out the old filter, and insert the new one with the arrow "
        "pointing toward the fan. Close the panel until it clicks, then restore power and reset the timer."
    ),
}

CJK = {
    "chinese": "我们今天去公园散步天气非常好",
    "japanese": "日本語のテキストですカタカナ",
    "korean": "한국어텍스트입니다",
    "emoji": "😀🎉🚀👍",
}

CHARS_PER_TOKEN_TARGET = 4.0
TOLERANCE_RATIO = 0.25


@pytest.mark.parametrize("text", PROSE.values(), ids=list(PROSE))
def test_english_prose_is_about_four_chars_per_token(text: str) -> None:
    chars_per_token = len(text) / len(tok.encode(text))
    assert abs(chars_per_token - CHARS_PER_TOKEN_TARGET) <= TOLERANCE_RATIO * CHARS_PER_TOKEN_TARGET


@pytest.mark.parametrize("text", CJK.values(), ids=list(CJK))
def test_cjk_and_emoji_are_one_token_per_character(text: str) -> None:
    assert len(tok.encode(text)) == len(text)


def test_encoding_is_deterministic_literal_ids() -> None:
    """Fixed ids: a change here changes every replayed trace's prefix hits."""
    assert tok.pieces("Hello, world! 12345") == ["Hello", ",", " world", "!", " 123", "45"]
    assert tok.encode("Hello, world! 12345") == [62863, 47059, 80822, 69748, 97641, 99671]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("internationalization", ["intern", "ationa", "lizati", "on"]),
        (" a  b", [" a", " ", " b"]),
        ("x!!!!!!", ["x", "!!!!", "!!"]),
    ],
    ids=["empty", "long-word", "spaces", "punctuation-run"],
)
def test_pieces(text: str, expected: list[str]) -> None:
    assert tok.pieces(text) == expected


def test_role_headers_are_single_special_tokens() -> None:
    assert tok.encode("<|user|>\nHi") == [tok.SPECIAL_TOKENS["<|user|>\n"], tok.piece_id("Hi")]


def test_ids_are_in_vocabulary_and_clear_of_reserved_ids() -> None:
    ids = tok.encode(" ".join(PROSE.values()) + "".join(CJK.values()))
    assert all(tok.RESERVED_IDS <= i < tok.VOCAB_SIZE for i in ids)


SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    ({"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}),
    ({"role": "user", "content": "  and 3+3?\n\n"}, {"role": "assistant", "content": "\n 6 "}),
    (
        {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                     {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]},
    ),
    ({"role": "tool", "content": "result: ok", "tool_call_id": "c1"}, {"role": "assistant", "content": "Done"}),
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("turn", range(1, len(TURNS)), ids=[f"turn{i + 1}" for i in range(1, len(TURNS))])
def test_earlier_turns_are_a_token_prefix_of_later_turns(turn: int, tools: list | None) -> None:
    """Turn k's prompt (history + generation prompt) prefixes turn k+1's, so the prefix cache hits."""
    history = [SYSTEM]
    for user, assistant in TURNS[:turn]:
        history += [user, assistant]
    earlier = [*history[:-1]]  # the prompt that produced the last assistant message
    later = [*history, TURNS[turn][0]]
    earlier_ids = tok.encode(tok.apply_chat_template(earlier, tools))
    later_ids = tok.encode(tok.apply_chat_template(later, tools))
    assert later_ids[: len(earlier_ids)] == earlier_ids
    assert len(later_ids) > len(earlier_ids)


def test_template_shape_is_documented_chatml() -> None:
    text = tok.apply_chat_template([SYSTEM, {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n"


def test_different_images_differ_and_same_image_matches() -> None:
    def prompt(url: str) -> list[int]:
        part = {"type": "image_url", "image_url": {"url": url}}
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": [part]}]))

    assert prompt("https://x/cat.png") == prompt("https://x/cat.png")
    assert prompt("https://x/cat.png") != prompt("https://x/dog.png")
    assert prompt("data:image/png;base64,AAAA") != prompt("data:image/png;base64,AAAB")


def test_token_text_is_deterministic_pseudo_words() -> None:
    texts = [tok.token_text(i) for i in range(1000, 1100)]
    assert texts == [tok.token_text(i) for i in range(1000, 1100)]
    assert all(t.startswith(" ") and t[1:].isalpha() for t in texts)
    assert len(set(texts)) > 90
