"""Trace loaders on the real files and on small edge cases; prompt text preserves prefixes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from mock_vllm import tokenizer
from sim.traces import (
    MOONCAKE_BLOCK_TOKENS, TraceRequest, chat_body, detect_format, load_azure, load_mooncake, load_sharegpt,
    load_trace, prompt_text,
)

RealTrace = Callable[[str], Path]  # the conftest's real_trace fixture: a name of sim.real_traces.REAL_TRACES -> path


# ---- real files -------------------------------------------------------------------------------

def test_mooncake_real_trace(real_trace: RealTrace) -> None:
    reqs = load_mooncake(real_trace("mooncake"))
    assert len(reqs) == 12_031
    assert reqs[0] == TraceRequest(arrival_s=0.0, input_tokens=6758, output_tokens=500, hash_ids=tuple(range(14)))
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / MOONCAKE_BLOCK_TOKENS) for r in reqs)
    assert all(r.hash_ids[0] == 0 for r in reqs)  # the shared system prefix (REFERENCE.md §7)
    assert reqs[10].arrival_s == 3.0
    assert 3500 < reqs[-1].arrival_s < 3600


def test_mooncake_limit(real_trace: RealTrace) -> None:
    assert len(load_trace(real_trace("mooncake"), limit=30)) == 30


@pytest.mark.parametrize(("name", "rows", "span_s"), [("azure-code", 8_819, 3_436), ("azure-conv", 19_366, 3_502)],
                         ids=["code", "conv"])
def test_azure_real_traces(real_trace: RealTrace, name: str, rows: int, span_s: float) -> None:
    reqs = load_trace(real_trace(name))
    assert len(reqs) == rows
    assert reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert reqs[-1].arrival_s == pytest.approx(span_s, abs=1.0)
    assert all(r.hash_ids == () and r.messages is None for r in reqs)


def test_azure_code_first_rows(real_trace: RealTrace) -> None:
    first, second = load_azure(real_trace("azure-code"), limit=2)
    assert (first.input_tokens, first.output_tokens) == (4808, 10)
    assert (second.input_tokens, second.output_tokens) == (3180, 8)
    assert second.arrival_s == pytest.approx(0.052, abs=1e-9)  # 18:17:04.0319600 − 18:17:03.9799600


def test_sharegpt_real_file(real_trace: RealTrace) -> None:
    sharegpt = real_trace("sharegpt-fastchat")
    convs = json.loads(sharegpt.read_text(encoding="utf-8"))
    assert len(convs) == 500
    human_turns = sum(t["from"] == "human" for c in convs for t in c["conversations"])
    reqs = load_sharegpt(sharegpt, rate_rps=10.0)
    assert len(reqs) == human_turns == 1000
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    # Turns of one conversation keep their order: each next one extends the previous history.
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id or "", []).append(r)
    for turns in by_session.values():
        for a, b in zip(turns, turns[1:]):
            assert b.messages is not None and a.messages is not None
            assert b.messages[: len(a.messages)] == a.messages and len(b.messages) == len(a.messages) + 2
    assert load_sharegpt(sharegpt, rate_rps=10.0) == reqs  # seeded
    assert detect_format(sharegpt) == "sharegpt"


# ---- small files ------------------------------------------------------------------------------

def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("line", "match"), [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 1, "output_length": 2, "hash_ids": [0]}', "'input_length' must be an integer"),
    ('{"timestamp": -5, "input_length": 3, "output_length": 2, "hash_ids": [0]}', "'timestamp'"),
    ('{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": ["a"]}', "'hash_ids'"),
    ("[1, 2]", "expected a JSON object"),
], ids=["json", "missing-field", "negative-time", "bad-hash", "not-object"])
def test_mooncake_bad_line_names_line_number(tmp_path: Path, line: str, match: str) -> None:
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'
    path = _write(tmp_path, "t.jsonl", f"{good}\n\n{line}\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:3: .*{match}"):
        load_mooncake(path)


def test_mooncake_limit_stops_before_a_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.jsonl", '{"timestamp": 1500, "input_length": 1, "output_length": 1}\n{bad\n')
    assert load_mooncake(path, limit=1) == [TraceRequest(arrival_s=1.5, input_tokens=1, output_tokens=1)]


def test_azure_timestamps_parse_robustly(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                     "2023-11-16 23:59:59.9999999,10,1\n"
                                     "2023-11-17 00:00:00,20,2\n"
                                     "2023-11-17T00:00:01.5,30,3\n")
    reqs = load_trace(path)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 1e-7, 1.5000001], abs=1e-12)
    assert [r.input_tokens for r in reqs] == [10, 20, 30]


@pytest.mark.parametrize(("text", "match"), [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,1\n", r"a\.csv:1: missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,1\nyesterday,1,1\n", r"a\.csv:3: "),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,x,1\n", r"a\.csv:2: "),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.12ab,1,1\n", r"a\.csv:2: bad fractional"),
], ids=["missing-column", "bad-time", "bad-int", "bad-fraction"])
def test_azure_bad_rows(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_azure(_write(tmp_path, "a.csv", text))


def test_sharegpt_history_and_lengths(tmp_path: Path) -> None:
    conv = [{"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "x" * 40},
        {"from": "human", "value": "Bye"},
    ]}]
    first, second = load_sharegpt(_write(tmp_path, "s.json", json.dumps(conv)), rate_rps=2.0)
    assert first.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"})
    assert first.output_tokens == 10 and first.session_id == "c1"
    assert second.messages is not None and second.messages[2] == {"role": "assistant", "content": "x" * 40}
    assert second.output_tokens >= 1 and second.arrival_s > first.arrival_s
    body = chat_body(second, model="m", index=1)
    assert body["messages"] == list(second.messages) and body["messages"] is not second.messages


@pytest.mark.parametrize(("doc", "match"), [
    ('{"a": 1}', "expected a JSON list"),
    ('[{"id": "x"}]', r"conversation \[0\]: missing 'conversations'"),
    ('[{"conversations": [{"from": "robot", "value": "hi"}]}]', r"conversation \[0\] turn \[0\]"),
    ("[{", "not valid JSON"),
], ids=["not-list", "no-turns", "bad-role", "bad-json"])
def test_sharegpt_bad_files(tmp_path: Path, doc: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_sharegpt(_write(tmp_path, "s.json", doc))


def test_detect_format_by_content_and_unknown(tmp_path: Path) -> None:
    assert detect_format(_write(tmp_path, "t.txt", '\n{"timestamp": 0}')) == "mooncake"
    assert detect_format(_write(tmp_path, "u.log", "TIMESTAMP,ContextTokens,GeneratedTokens\n")) == "azure"
    with pytest.raises(ValueError, match="cannot tell"):
        detect_format(_write(tmp_path, "v.log", "hello"))
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "t.txt", fmt="parquet")


# ---- prompt text ------------------------------------------------------------------------------

def _req(hash_ids: tuple[int, ...], input_tokens: int) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, input_tokens=input_tokens, output_tokens=8, hash_ids=hash_ids)


def test_one_block_is_512_mock_tokens() -> None:
    for hash_id in (0, 1, 77, 123_456):
        text = prompt_text(_req((hash_id,), MOONCAKE_BLOCK_TOKENS))
        assert abs(tokenizer.count_tokens(text) - 512) <= 0.02 * 512
        assert prompt_text(_req((hash_id,), MOONCAKE_BLOCK_TOKENS)) == text  # fixed per id


def test_shared_leading_ids_share_exact_leading_text() -> None:
    a = prompt_text(_req((0, 1, 2, 3), 1800))
    b = prompt_text(_req((0, 1, 2, 9), 1700))
    c = prompt_text(_req((0, 5, 2, 3), 1800))
    block_chars = len(prompt_text(_req((0,), 512)))
    assert a[: 3 * block_chars] == b[: 3 * block_chars]
    assert a[3 * block_chars : 3 * block_chars + 40] != b[3 * block_chars : 3 * block_chars + 40]
    assert a[:block_chars] == c[:block_chars] and a[block_chars : block_chars + 40] != c[block_chars : block_chars + 40]
    # A partial last block is the prefix of the full one.
    assert prompt_text(_req((0, 1), 700)) == prompt_text(_req((0, 1), 1024))[: len(prompt_text(_req((0, 1), 700)))]


@pytest.mark.parametrize("input_tokens", [1, 511, 512, 513, 6758])
def test_token_count_matches_input_tokens(input_tokens: int) -> None:
    hash_ids = tuple(range(math.ceil(input_tokens / 512)))
    assert tokenizer.count_tokens(prompt_text(_req(hash_ids, input_tokens))) == pytest.approx(input_tokens, rel=0.02)


def test_records_without_hash_ids_share_nothing() -> None:
    azure = TraceRequest(arrival_s=1.25, input_tokens=300, output_tokens=3)
    one, two = prompt_text(azure, index=0), prompt_text(azure, index=1)
    assert one != two and one[:40] != two[:40]
    assert prompt_text(azure, index=0) == one  # deterministic
    assert tokenizer.count_tokens(one) == pytest.approx(300, rel=0.02)
    # Tokens beyond the hash ids' coverage are unique filler, never another record's block.
    assert tokenizer.count_tokens(prompt_text(_req((0,), 600), index=3)) == pytest.approx(600, rel=0.02)


def test_chat_body_shapes() -> None:
    req = _req((0, 1), 600)
    body = chat_body(req, model="llama", index=4)
    assert body["model"] == "llama" and body["max_tokens"] == 8 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": prompt_text(req, index=4)}]
    plain = chat_body(TraceRequest(arrival_s=0.0, input_tokens=5, output_tokens=0), model="m", index=0, stream=False)
    assert plain["max_tokens"] == 1 and "stream_options" not in plain and plain["stream"] is False
