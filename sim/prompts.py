"""The simulated prompt of a trace record, as the engine and as the gateway see it.

A Mooncake record names its prompt by 512-token hash blocks (`sim.traces`). Here each block
becomes fixed content drawn from its key alone, 4 bytes per token::

    raw(key)   = SHAKE-128(key), 4 · 512 bytes           key = the hash id (or, for
                                                           tokens past the hash ids' cover,
                                                           the record's index and position)
    engine     : token id p of the block = raw bytes [4p, 4p+4) as a little-endian uint32
    gateway    : text byte i of the block = a letter chosen by raw[i], a space at i ≡ 0 (mod 4)
                 — " abc" words, one per token, as `sim.traces.prompt_text` writes them

so two records share exactly their common leading hash ids, in tokens (the engine's
prefix cache) and in text (the gateway's index), and nothing else. The last block of a
record is cut to its remaining tokens. This is `sim.traces.prompt_text`'s scheme with a
hash in place of `random.Random(...).choices`, far cheaper per block, chosen so the whole
conversation trace (183k distinct blocks) is prepared in seconds; token ids are
opaque 32-bit values, which is all the engine's hashing reads.

The gateway's view is computed exactly as `gateway.routing` computes it for a chat request
with one user message: canonical bytes (`prefix_index.chat_canonical_bytes`; the text has
no reserved characters, so it is the fixed header + the text), chained block hashes
(`prefix_index.block_hashes`) seeded by `chain_seed(model, None)`. `prepare_trace` does
this once per trace and fleet, and every policy's run shares the result.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_index import block_hashes, chain_seed, chat_canonical_bytes
from sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

TEXT_BYTES_PER_TOKEN = 4
"""Bytes of gateway text per engine token in this synthetic text (one `" abc"` word per token, as
`sim.traces.prompt_text` writes): a property of the format, not an estimate (the gateway's
estimate is `prefix_index.BYTES_PER_TOKEN_ESTIMATE`, calibrated online)."""

_LETTERS = b"abcdefghijklmnopqrstuvwxyz"
_TO_LETTERS = bytes.maketrans(bytes(range(256)), bytes(_LETTERS[i % 26] for i in range(256)))
_PLACEHOLDER = "\x00PROMPT\x00"
_CANONICAL_HEAD, _CANONICAL_TAIL = chat_canonical_bytes(
    {"messages": [{"role": "user", "content": _PLACEHOLDER}]}).split(_PLACEHOLDER.encode())


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One trace record with its gateway-side prompt figures computed.

    Args:
        index: position in the trace (also the engine request id).
        arrival_s: arrival time, s.
        input_tokens: prompt tokens the engine will see.
        max_tokens: tokens to generate, ≥ 1 (the trace's output length; 0 becomes 1).
        hash_ids: the record's 512-token blocks.
        prompt_bytes: length of the canonical bytes the gateway hashes.
        hashes: the gateway's chained index-block hashes (uint64).
    """

    index: int
    arrival_s: float
    input_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...]
    prompt_bytes: int
    hashes: array


def _raw_block(key: bytes, block_tokens: int) -> bytes:
    return hashlib.shake_128(key).digest(TEXT_BYTES_PER_TOKEN * block_tokens)


def _raw_blocks(index: int, hash_ids: Sequence[int], input_tokens: int, block_tokens: int) -> list[bytes]:
    """The raw bytes of each block of a record, cut to ``input_tokens`` tokens in all."""
    parts: list[bytes] = []
    remaining = input_tokens
    for hash_id in hash_ids:
        if remaining <= 0:
            break
        raw = _raw_block(b"h%d" % hash_id, block_tokens)
        take = min(remaining, block_tokens)
        parts.append(raw if take == block_tokens else raw[: take * TEXT_BYTES_PER_TOKEN])
        remaining -= take
    extra = 0
    while remaining > 0:  # tokens the hash ids do not cover: this record's own text
        take = min(remaining, block_tokens)
        parts.append(_raw_block(b"u%d:%d" % (index, extra), block_tokens)[: take * TEXT_BYTES_PER_TOKEN])
        remaining -= take
        extra += 1
    return parts


def _text(raw: bytes) -> bytes:
    text = bytearray(raw.translate(_TO_LETTERS))
    text[0::TEXT_BYTES_PER_TOKEN] = b" " * (len(text) // TEXT_BYTES_PER_TOKEN)
    return bytes(text)


def canonical_bytes(req: TraceRequest, index: int, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> bytes:
    """The gateway's canonical bytes for ``req`` sent as one user message (see the module docstring)."""
    text = b"".join(_text(raw) for raw in _raw_blocks(index, req.hash_ids, req.input_tokens, block_tokens))
    return _CANONICAL_HEAD + text + _CANONICAL_TAIL


def token_ids(req: PreparedRequest, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> array:
    """The engine's prompt token ids for ``req``: ``input_tokens`` uint32 values (see the module docstring)."""
    out = array("I")
    out.frombytes(b"".join(_raw_blocks(req.index, req.hash_ids, req.input_tokens, block_tokens)))
    return out


def prepare_trace(requests: Sequence[TraceRequest], *, model: str, block_size_bytes: int,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[PreparedRequest]:
    """Compute every record's gateway hashes once, for all the runs over one trace and fleet.

    Args:
        requests: the trace, any order (the simulator orders by arrival).
        model: the served model name (seeds the hash chain, as the gateway does).
        block_size_bytes: the gateway's index block, bytes (`prefix_index.block_size_bytes`).
        block_tokens: tokens per trace hash block (Mooncake: 512).

    Returns:
        One `PreparedRequest` per record, in the input order.

    Raises:
        ValueError: a record carries chat ``messages`` (ShareGPT): only length/hash-id
            records are simulated.
    """
    seed = chain_seed(model, None)
    out = []
    for i, req in enumerate(requests):
        if req.messages is not None:
            raise ValueError(f"record {i}: chat-message records are not simulated; use length/hash-id traces")
        data = canonical_bytes(req, i, block_tokens=block_tokens)
        hashes = array("Q", block_hashes(data, block_size_bytes=block_size_bytes, seed=seed))
        out.append(PreparedRequest(i, req.arrival_s, req.input_tokens, max(req.output_tokens, 1),
                                   req.hash_ids, len(data), hashes))
    return out
