"""The shipped tokenizer (assets/tokenizers/kappa-mock-bpe): it loads, encodes to fixed ids, keeps
its prose density, keeps multi-turn prefixes, and retraining reproduces it byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.mock_vllm.test_tokenizer import PROSE
from tokenization import EngineTokenizer, request_token_ids
from tokenization import train as training

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "assets" / "tokenizers" / "kappa-mock-bpe"
TOK = EngineTokenizer.from_dir(SHIPPED)
BOS, USER, ASSISTANT, SYSTEM = 1, 5, 6, 3

# Ids read off the shipped file once (decoded pieces in the comments); any retraining that moves
# them must be deliberate.
FIXED = {
    "The gateway routes each request.": [1, 405, 441, 1962, 499, 393, 23],  # The| gateway| routes| each| request|.
    "Hello world": [1, 9381, 4751, 734],  # Hello| wor|ld
    "12345 tokens": [1, 5031, 1240, 611],  # 123|45| tokens  (digits in groups of three)
    "κ_crit": [1, 542, 805],  # κ|_crit
}


def test_it_loads_with_its_vocabulary_special_tokens_and_template() -> None:
    assert (TOK.name, TOK.vocab_size) == ("kappa-mock-bpe", 32_000)
    assert TOK.special_tokens["bos_token"] == "<|bos|>" and TOK.special_tokens["eos_token"] == "<|eos|>"
    headers = ["<|system|>\n", "<|developer|>\n", "<|user|>\n", "<|assistant|>\n", "<|tool|>\n", "<|function|>\n",
               "<|tools|>\n"]
    assert [TOK.encode(h, add_special_tokens=False) for h in headers] == [[i] for i in range(3, 10)]
    assert TOK.template is not None and SHIPPED.joinpath("tokenizer.json").stat().st_size < 1_000_000


@pytest.mark.parametrize("text", FIXED)
def test_a_completion_prompt_encodes_to_fixed_ids_with_bos(text: str) -> None:
    assert TOK.prompt_token_ids(text) == FIXED[text]
    assert TOK.decode(FIXED[text]) == "<|bos|>" + text  # byte-level: lossless


def test_english_prose_not_in_the_training_text_is_about_three_and_a_half_bytes_per_token() -> None:
    """README.md's figure: 3.63 bytes per token over the three held-out paragraphs (3.4-4.1 each)."""
    text = " ".join(PROSE.values())
    density = len(text.encode()) / len(TOK.encode(text, add_special_tokens=False))
    assert density == pytest.approx(3.63, abs=0.01)
    for paragraph in PROSE.values():
        assert 3.3 < len(paragraph.encode()) / len(TOK.encode(paragraph, add_special_tokens=False)) < 4.1


def test_a_chat_renders_the_mock_layout_and_encodes_without_a_second_bos() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]}
    ids = request_token_ids(TOK, body, chat=True)
    assert TOK.decode(ids) == "<|bos|><|system|>\nBe brief.\n<|user|>\nHello world\n<|assistant|>\n"
    # BOS once (written by the template), each header one id, the text between them as in a prompt.
    hello = FIXED["Hello world"][1:]
    assert ids == [BOS, SYSTEM, *TOK.encode("Be brief.\n", add_special_tokens=False), USER,
                   *TOK.encode("Hello world\n", add_special_tokens=False), ASSISTANT]
    assert ids[ids.index(USER) + 1:][:len(hello)] == hello


def test_the_ids_of_earlier_turns_are_a_prefix_of_the_longer_conversation() -> None:
    turns = [{"role": "system", "content": "You answer questions about caches."},
             {"role": "user", "content": "What is a prefix cache?"},
             {"role": "assistant", "content": "It keeps the KV of prompts it has seen."},
             {"role": "user", "content": "And when does it miss?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "evicted"},
             {"role": "assistant", "content": "When its blocks were evicted."},
             {"role": "user", "content": [{"type": "text", "text": "Thanks."}, {"type": "text", "text": "Bye."}]}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    previous: list[int] = []
    requests = [n for n in range(2, len(turns) + 1) if turns[n - 1]["role"] != "assistant"]
    assert requests == [2, 4, 6, 8]
    for n in requests:  # each request: the previous one, its answer (after the generation prompt), the new turn
        ids = request_token_ids(TOK, {"messages": turns[:n], "tools": tools}, chat=True)
        assert ids[:len(previous)] == previous, f"the request of {n} messages does not extend the one before"
        assert ids[-1] == ASSISTANT and len(ids) > len(previous)
        previous = ids


def test_retraining_from_the_shipped_corpus_reproduces_the_shipped_files(tmp_path: Path) -> None:
    training.main(["--out", str(tmp_path), "--corpus", str(SHIPPED / training.CORPUS_FILE)])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), name


def test_a_traces_synthetic_prompt_keeps_its_token_count() -> None:
    """`sim.traces` writes a trace's n tokens as n three-letter words; each is one token here, as under
    the mock's own tokenizer, so a replayed Mooncake prompt is as long as the trace says."""
    from sim.traces import unique_words

    for seed, n in (("a", 1), ("b", 517), ("c", 4096)):
        assert len(TOK.encode(unique_words(seed, n), add_special_tokens=False)) == n
