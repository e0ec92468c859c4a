"""Request traces as one record type, and the text a replayer sends for each record.

Shared by ``kappa-gateway replay`` (real HTTP) and the simulator (virtual time). Pure: the
standard library only, and no I/O beyond reading the file a loader is given.

Formats (../shared/data/*/README.md, REFERENCE.md §7):

* **Mooncake** JSONL (FAST'25, https://github.com/kvcache-ai/Mooncake ``FAST25-release``):
  ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``; each hash id
  names a 512-token prefix block (the last may be partial); equal ids at equal positions
  are a shared prefix.
* **Azure LLM inference 2023** CSV (Splitwise, ISCA'24): ``TIMESTAMP,ContextTokens,
  GeneratedTokens`` with wall-clock timestamps; no prefix information.
* **ShareGPT** JSON: ``[{"id", "conversations": [{"from", "value"}, ...]}]``; every human
  turn becomes a request carrying the whole chat so far. Arrivals are synthetic (Poisson).

Prompt text (`prompt_text`): each hash id becomes a fixed pseudo-random block of words
drawn from the id alone, so two records sharing leading ids share exactly that leading
text, and hence the same prefix-cache hits on any backend. Words are three lowercase
letters with a leading space (``" abc"``): one token each under the mock tokenizer
(`mock_vllm.tokenizer`) and about one under BPE tokenizers, four bytes per token.
"""

from __future__ import annotations

import csv
import functools
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prefix_index import BYTES_PER_TOKEN_ESTIMATE

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake hash block (FAST25-release/README.md)."""
"""ShareGPT has text, not token counts: ≈ 4 characters per token for English (GPT/Llama BPE)."""
DEFAULT_SHAREGPT_RATE_RPS = 1.0
"""Synthetic arrival rate for ShareGPT, requests per second."""
DEFAULT_SHAREGPT_OUTPUT_TOKENS = 128
"""max_tokens for a human turn with no recorded answer (a conversation ending on a question)."""
FORMATS = ("mooncake", "azure", "sharegpt")

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORDS = tuple(" " + a + b + c for a in _LETTERS for b in _LETTERS for c in _LETTERS)  # 17,576 words
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Records with ``messages`` hold dicts, so they are not hashable."""

    arrival_s: float
    """Seconds from the trace start, ≥ 0."""
    input_tokens: int
    """Prompt length, tokens (ShareGPT: estimated from characters)."""
    output_tokens: int
    """Tokens to generate (becomes max_tokens), ≥ 1 in the shipped traces."""
    hash_ids: tuple[int, ...] = ()
    """Mooncake 512-token prefix blocks (the last may be partial); empty when unknown."""
    messages: tuple[dict, ...] | None = None
    """ShareGPT: the chat so far as OpenAI message dicts (read-only by convention)."""
    session_id: str | None = None
    """The conversation a request belongs to, when the trace says (ShareGPT ``id``)."""


def _where(path: Path, line_no: int) -> str:
    return f"{path}:{line_no}"


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be ≥ 0 or None, got {limit}")


def _int_field(record: dict, key: str, where: str, minimum: int) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key!r} must be an integer ≥ {minimum}, got {value!r}")
    return value


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace, in file order.

    Args:
        path: the ``.jsonl`` file; blank lines are skipped.
        limit: keep only the first ``limit`` records (None: all).

    Returns:
        One `TraceRequest` per line with ``arrival_s = timestamp / 1000`` and ``hash_ids``.

    Raises:
        ValueError: a line is not JSON or misses/has a bad field; the message names
            ``path:line``.
    """
    _check_limit(limit)
    path = Path(path)
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = _where(path, line_no)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            timestamp = record.get("timestamp")
            if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
                raise ValueError(f"{where}: 'timestamp' must be a number of ms ≥ 0, got {timestamp!r}")
            hash_ids = record.get("hash_ids", [])
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                         for h in hash_ids):
                raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
            out.append(TraceRequest(
                arrival_s=timestamp / 1000.0, input_tokens=_int_field(record, "input_length", where, 1),
                output_tokens=_int_field(record, "output_length", where, 0), hash_ids=tuple(hash_ids)))
    return out


def _parse_timestamp_ns(text: str) -> int:
    """``2023-11-16 18:17:03.9799600`` (any number of fractional digits) → ns since the epoch, naive."""
    base, _, frac = text.strip().partition(".")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in {text!r}")
    whole = datetime.fromisoformat(base)
    seconds = int((whole - datetime(1970, 1, 1, tzinfo=whole.tzinfo)).total_seconds())
    return seconds * 1_000_000_000 + int((frac + "000000000")[:9])


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure LLM inference 2023 CSV trace, in file order.

    Args:
        path: CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens``.
        limit: keep only the first ``limit`` rows (None: all).

    Returns:
        One `TraceRequest` per row, ``arrival_s`` relative to the first row (s), no hash ids.

    Raises:
        ValueError: a missing column or a bad row; the message names ``path:line``.
    """
    _check_limit(limit)
    path = Path(path)
    out: list[TraceRequest] = []
    first_ns: int | None = None
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{_where(path, 1)}: missing column(s) {sorted(missing)}")
        for row in reader:
            if limit is not None and len(out) >= limit:
                break
            where = _where(path, reader.line_num)
            try:
                stamp_ns = _parse_timestamp_ns(row["TIMESTAMP"] or "")
                context, generated = int(row["ContextTokens"] or ""), int(row["GeneratedTokens"] or "")
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            if context < 1 or generated < 0:
                raise ValueError(f"{where}: token counts out of range ({context}, {generated})")
            first_ns = stamp_ns if first_ns is None else first_ns
            out.append(TraceRequest(arrival_s=(stamp_ns - first_ns) / 1e9, input_tokens=context,
                                    output_tokens=generated))
    return out


def _estimate_tokens(text: str) -> int:
    return max(1, round(len(text.encode()) / BYTES_PER_TOKEN_ESTIMATE))


def load_sharegpt(path: str | Path, limit: int | None = None, rate_rps: float = DEFAULT_SHAREGPT_RATE_RPS,
                  seed: int = 0) -> list[TraceRequest]:
    """Read ShareGPT conversations: one request per human turn, with the history so far.

    Arrivals are a Poisson process at ``rate_rps``; conversations are interleaved at random
    (seeded) while each one's turns keep their order. ``output_tokens`` is the next answer's
    UTF-8 length / `prefix_index.BYTES_PER_TOKEN_ESTIMATE` (min 1), ``input_tokens`` the history's estimate.

    Args:
        path: a JSON list of ``{"id", "conversations": [{"from", "value"}]}``.
        limit: keep the first ``limit`` requests by arrival (None: all).
        rate_rps: mean arrival rate, requests per second, > 0.
        seed: seeds the interleaving and the inter-arrival gaps.

    Raises:
        ValueError: bad JSON, structure or role; the message names the conversation index.
    """
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    _check_limit(limit)
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{_where(path, exc.lineno)}: not valid JSON ({exc.msg})") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    sessions = [_sharegpt_session(f"{path}: conversation [{i}]", i, conv) for i, conv in enumerate(data)]
    return _interleave(sessions, limit, rate_rps, random.Random(seed))


def _sharegpt_session(where: str, i: int, conv: object) -> list[TraceRequest]:
    """One ShareGPT conversation's requests (one per human turn, with the history so far), at arrival 0.

    Raises:
        ValueError: not a conversation, or a turn without a known role and a string value
            (the message starts with ``where``).
    """
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(conv, dict) or not isinstance(turns, list):
        raise ValueError(f"{where}: missing 'conversations' list")
    session_id = str(conv.get("id", i))
    history: list[dict[str, Any]] = []
    requests: list[TraceRequest] = []
    for j, turn in enumerate(turns):
        role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(value, str):
            raise ValueError(f"{where} turn [{j}]: need 'from' in {sorted(_ROLES)} and a string 'value'")
        history.append({"role": role, "content": value})
        if role != "user":
            continue
        answer = turns[j + 1] if j + 1 < len(turns) and isinstance(turns[j + 1], dict) else {}
        answered = _ROLES.get(answer.get("from")) == "assistant" and isinstance(answer.get("value"), str)
        output = _estimate_tokens(answer["value"]) if answered else DEFAULT_SHAREGPT_OUTPUT_TOKENS
        prompt = _estimate_tokens("".join(m["content"] for m in history))
        requests.append(TraceRequest(arrival_s=0.0, input_tokens=prompt, output_tokens=output,
                                     messages=tuple(dict(m) for m in history), session_id=session_id))
    return requests


def _interleave(sessions: list[list[TraceRequest]], limit: int | None, rate_rps: float,
                rng: random.Random) -> list[TraceRequest]:
    """The sessions' requests interleaved at random (each session's in order), the first
    ``limit`` of them given Poisson arrivals at ``rate_rps`` (per second)."""
    slots = [s for s, reqs in enumerate(sessions) for _ in reqs]
    rng.shuffle(slots)
    cursors = [0] * len(sessions)
    out: list[TraceRequest] = []
    now_s = 0.0
    for s in slots[:limit] if limit is not None else slots:
        req = sessions[s][cursors[s]]
        cursors[s] += 1
        out.append(TraceRequest(arrival_s=now_s, input_tokens=req.input_tokens, output_tokens=req.output_tokens,
                                messages=req.messages, session_id=req.session_id))
        now_s += rng.expovariate(rate_rps)
    return out


def detect_format(path: str | Path) -> str:
    """``mooncake``, ``azure`` or ``sharegpt`` from the extension, else from the first bytes.

    Raises:
        ValueError: neither the extension nor the content says.
    """
    path = Path(path)
    by_suffix = {".jsonl": "mooncake", ".csv": "azure", ".json": "sharegpt"}
    if path.suffix.lower() in by_suffix:
        return by_suffix[path.suffix.lower()]
    with path.open(encoding="utf-8") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith("["):
        return "sharegpt"
    if head.startswith("{"):
        return "mooncake"
    if head.upper().startswith("TIMESTAMP"):
        return "azure"
    raise ValueError(f"{path}: cannot tell the trace format; pass one of {FORMATS}")


def load_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[TraceRequest]:
    """Load any supported trace; ``fmt`` is ``auto`` (`detect_format`) or one of `FORMATS`.

    Raises:
        ValueError: unknown format, or the loader's own errors.
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    loaders = {"mooncake": load_mooncake, "azure": load_azure, "sharegpt": load_sharegpt}
    if fmt not in loaders:
        raise ValueError(f"unknown trace format {fmt!r}; expected 'auto' or one of {FORMATS}")
    return loaders[fmt](path, limit=limit)


# 16,384 blocks × 2 KiB of text = 32 MiB at most; a conversation trace reuses recent blocks
# (the growing history) and block 0 (the shared system prompt), which LRU keeps.
BLOCK_CACHE_SIZE = 16_384


@functools.lru_cache(maxsize=BLOCK_CACHE_SIZE)
def _block_words(hash_id: int, block_tokens: int) -> str:
    """The fixed text of one hash block: ``block_tokens`` words drawn from the id alone."""
    return "".join(random.Random(f"mooncake-block-{hash_id}").choices(_WORDS, k=block_tokens))


def unique_words(seed: str, tokens: int) -> str:
    """``tokens`` words of the form ``" abc"`` drawn from ``seed`` alone (text no other seed shares)."""
    return "".join(random.Random(f"unique-{seed}").choices(_WORDS, k=tokens))


def prompt_text(req: TraceRequest, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, index: int | None = None) -> str:
    """The prompt a replayer sends for a record of lengths only, ≈ ``req.input_tokens`` tokens.

    Each hash id contributes its fixed block (`_block_words`), the last one truncated so the
    total is ``input_tokens`` words; tokens beyond the hash ids' coverage (and whole prompts
    without hash ids, e.g. Azure) are unique text seeded by ``index`` and the record, so
    they share nothing with other records.

    Args:
        req: the record; ``messages`` is ignored here.
        block_tokens: tokens per hash block, > 0 (Mooncake: 512).
        index: the record's position in its trace; keeps records with equal fields distinct.

    Returns:
        ``input_tokens`` words of the form ``" abc"`` (four characters each).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    parts: list[str] = []
    remaining = req.input_tokens
    for hash_id in req.hash_ids:
        if remaining <= 0:
            break
        block = _block_words(hash_id, block_tokens)
        take = min(remaining, block_tokens)
        parts.append(block if take == block_tokens else block[: take * 4])
        remaining -= take
    if remaining > 0:
        parts.append(unique_words(f"{index}-{req.arrival_s!r}-{req.input_tokens}-{req.output_tokens}", remaining))
    return "".join(parts)


def chat_body(req: TraceRequest, *, model: str, index: int, stream: bool = True) -> dict[str, Any]:
    """An OpenAI chat-completions request body for ``req``.

    Args:
        req: the record: ShareGPT history as ``messages``, else one user message of `prompt_text`.
        model: the ``model`` field.
        index: the record's position in its trace (seeds unique text).
        stream: stream the answer; adds ``stream_options.include_usage`` so usage arrives last.

    Returns:
        A JSON-ready dict with ``max_tokens = max(output_tokens, 1)`` (the API rejects 0).
    """
    if req.messages is not None:
        messages = [dict(m) for m in req.messages]
    else:
        messages = [{"role": "user", "content": prompt_text(req, index=index)}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max(req.output_tokens, 1),
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
