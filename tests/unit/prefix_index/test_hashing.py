"""Chained block hashes: the chain property, seeds, full blocks only, UTF-8 boundaries."""

from __future__ import annotations

import math
import random

import pytest
import xxhash

from prefix_index import (
    BYTES_PER_TOKEN_ESTIMATE,
    DEFAULT_BLOCK_SIZE_TOKENS,
    block_hashes,
    block_size_bytes,
    chain_seed,
)

SEED = chain_seed("llama-3-8b", None)
UNICODE_TEXT = ("Prefix caching 前缀缓存 🧠🚀 naïve café e\u0301 " * 4).encode()
# Computed once from the algorithm in prefix_index/hashing.py; a change of hash function,
# seed derivation or boundary rule must show up here.
UNICODE_HASHES_32 = [
    7249603572419492343, 17706651592896768725, 16047851500263032919,
    4698496187375008618, 16939464284312057311, 16090124243500865159,
]
SEED_PLAIN = 4342391428960355933
SEED_SALTED = 17055479513023490160


def ascii_text(n_bytes: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    return bytes(rnd.choice(b"abcdefghij ") for _ in range(n_bytes))


def reference_hashes(data: bytes, size: int, seed: int) -> tuple[list[int], list[bytes]]:
    """Independent restatement: boundary k = last character start at or before k*size."""
    text = data.decode("utf-8")
    starts, offset = [], 0
    for ch in text:
        starts.append(offset)
        offset += len(ch.encode())
    starts.append(len(data))
    blocks, hashes, prev, h = [], [], 0, seed
    for k in range(1, len(data) // size + 1):
        end = max(s for s in starts if s <= k * size)
        blocks.append(data[prev:end])
        h = xxhash.xxh3_64_intdigest(data[prev:end], h)
        hashes.append(h)
        prev = end
    return hashes, blocks


def test_fixed_input_gives_fixed_hashes() -> None:
    assert chain_seed("llama-3-8b", None) == SEED_PLAIN
    assert chain_seed("llama-3-8b", "tenant-7") == SEED_SALTED
    assert block_hashes(UNICODE_TEXT, block_size_bytes=32, seed=SEED) == UNICODE_HASHES_32
    assert block_hashes(UNICODE_TEXT, block_size_bytes=32, seed=SEED) == UNICODE_HASHES_32


def test_shared_prefix_gives_shared_leading_hashes() -> None:
    shared = ascii_text(5 * 64 + 20)
    a = block_hashes(shared + b"first continuation" * 20, block_size_bytes=64, seed=SEED)
    b = block_hashes(shared + b"other continuation" * 20, block_size_bytes=64, seed=SEED)
    assert a[:5] == b[:5]
    assert all(x != y for x, y in zip(a[5:], b[5:]))


@pytest.mark.parametrize("position", [0, 1, 63, 64, 65, 500, 1023])
def test_one_byte_change_changes_its_block_and_every_later_one(position: int) -> None:
    data = ascii_text(1024)
    changed = bytearray(data)
    changed[position] = ord("Z")
    a = block_hashes(data, block_size_bytes=64, seed=SEED)
    b = block_hashes(bytes(changed), block_size_bytes=64, seed=SEED)
    first_changed = position // 64
    assert a[:first_changed] == b[:first_changed]
    assert all(x != y for x, y in zip(a[first_changed:], b[first_changed:]))
    assert len(a) == len(b) == 16


def test_models_and_salts_never_share_hashes() -> None:
    data = ascii_text(2048)
    seeds = [chain_seed("m1", None), chain_seed("m2", None), chain_seed("m1", "s1"), chain_seed("m1", "s2")]
    assert len(set(seeds)) == 4
    chains = [set(block_hashes(data, block_size_bytes=64, seed=s)) for s in seeds]
    for i, a in enumerate(chains):
        for b in chains[i + 1 :]:
            assert not a & b


@pytest.mark.parametrize(
    ("n_bytes", "expected_blocks"),
    [(0, 0), (63, 0), (64, 1), (65, 1), (10 * 64 + 7, 10), (10 * 64, 10)],
)
def test_only_full_blocks_are_hashed(n_bytes: int, expected_blocks: int) -> None:
    assert len(block_hashes(ascii_text(n_bytes), block_size_bytes=64, seed=SEED)) == expected_blocks


@pytest.mark.parametrize("size", [4, 5, 6, 7, 13, 32, 61, 256])
@pytest.mark.parametrize(
    "text",
    [
        pytest.param("🧠🚀👋🏽" * 40, id="emoji"),
        pytest.param("前缀缓存和注意力机制" * 30, id="cjk"),
        pytest.param("e\u0301a\u0300o\u0302" * 60, id="combining"),
        pytest.param("ab€😀c中" * 50, id="mixed-widths"),
    ],
)
def test_blocks_never_split_a_character(text: str, size: int) -> None:
    data = text.encode()
    expected, blocks = reference_hashes(data, size, SEED)
    for block in blocks:
        block.decode("utf-8")  # raises if a character was split
    assert block_hashes(data, block_size_bytes=size, seed=SEED) == expected
    assert len(expected) == len(data) // size


def test_hashes_are_unsigned_64_bit() -> None:
    hashes = block_hashes(ascii_text(4096), block_size_bytes=16, seed=(1 << 64) - 1)
    assert all(0 <= h < 1 << 64 for h in hashes)


def test_bytes_that_are_not_utf8_still_hash_on_the_grid() -> None:
    data = bytes([0x80]) * 100  # continuation bytes only: no character start to move to
    assert len(block_hashes(data, block_size_bytes=8, seed=SEED)) == 12


@pytest.mark.parametrize("size", [-1, 0, 3])
def test_block_hashes_rejects_tiny_blocks(size: int) -> None:
    with pytest.raises(ValueError, match="block_size_bytes must be >= 4"):
        block_hashes(b"abcdefgh", block_size_bytes=size, seed=SEED)


@pytest.mark.parametrize(
    ("tokens", "bytes_per_token", "expected"),
    [
        pytest.param(DEFAULT_BLOCK_SIZE_TOKENS, BYTES_PER_TOKEN_ESTIMATE, 256, id="default"),
        pytest.param(16, 3.7, 59, id="rounds"),
        pytest.param(1, 4.0, 4, id="smallest"),
    ],
)
def test_block_size_bytes(tokens: int, bytes_per_token: float, expected: int) -> None:
    assert block_size_bytes(tokens, bytes_per_token) == expected


@pytest.mark.parametrize(
    ("tokens", "bytes_per_token", "message"),
    [
        pytest.param(0, 4.0, "block_size_tokens must be a positive int", id="zero-tokens"),
        pytest.param(-64, 4.0, "block_size_tokens must be a positive int", id="negative-tokens"),
        pytest.param(True, 4.0, "block_size_tokens must be a positive int", id="bool-tokens"),
        pytest.param(64, 0.0, "bytes_per_token must be finite and > 0", id="zero-bpt"),
        pytest.param(64, -2.0, "bytes_per_token must be finite and > 0", id="negative-bpt"),
        pytest.param(64, math.nan, "bytes_per_token must be finite and > 0", id="nan-bpt"),
        pytest.param(64, math.inf, "bytes_per_token must be finite and > 0", id="inf-bpt"),
        pytest.param(1, 1.0, "need >= 4", id="under-4-bytes"),
    ],
)
def test_block_size_bytes_rejects_bad_arguments(tokens: int, bytes_per_token: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_size_bytes(tokens, bytes_per_token)
