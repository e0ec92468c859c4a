"""Issue 14: the C block hashing (``prefix_index/_chain.c``) gives exactly the Python loop's hashes.

`prefix_index.hashing.block_hashes_python` is the definition; the C extension must agree on
every boundary case: empty and short data, grids that land on each byte of 2-, 3- and 4-byte
UTF-8 characters, non-UTF-8 bytes (the backoff finds no lead byte), every block size from 4
up, seeds across the 64-bit range. Skipped where the extension was not built (a machine
without a C compiler or ``xxhash.h``, or ``KAPPA_PURE_PYTHON`` set); CI builds it
(`tests/unit/hot_path/test_switch.py` fails there if it did not).
"""

from __future__ import annotations

import random

import pytest
import xxhash

import prefix_index.hashing as hashing
from prefix_index.hashing import block_hashes, block_hashes_python

chain = pytest.importorskip("prefix_index._chain", reason="the C block hashing is not built here (hot_path)")

ALPHABET = "ab é€😀\n\u0300"  # 1-, 2-, 3- and 4-byte characters, and a combining mark


def cases() -> list[tuple[bytes, int, int]]:
    rnd = random.Random(14)
    out = [(b"", 4, 0), (b"abc", 4, 1), (b"abcd", 4, 2**64 - 1)]
    for size in range(4, 12):  # every grid offset inside each character width
        for char in ("é", "€", "😀"):
            for lead in range(size):
                out.append((b"a" * lead + char.encode() * 40, size, rnd.getrandbits(64)))
    for _ in range(600):
        n = rnd.randint(0, 2_000)
        if rnd.random() < 0.3:
            data = rnd.randbytes(n)  # not UTF-8: continuation runs longer than 3 bytes too
        else:
            data = "".join(rnd.choice(ALPHABET) for _ in range(n // 2)).encode()
        out.append((data, rnd.choice([4, 5, 7, 16, 64, 255, 256]), rnd.getrandbits(64)))
    return out


def test_the_c_loop_gives_the_python_loops_hashes_on_every_boundary_case() -> None:
    for data, size, seed in cases():
        assert chain.block_hashes(data, size, seed) == block_hashes_python(data, size, seed), (data[:40], size, seed)


def test_block_hashes_runs_the_c_loop_here_and_it_matches_xxhash_block_by_block() -> None:
    assert hashing._block_hashes_c is chain.block_hashes
    data = ("word " * 2_000).encode()
    hashes = block_hashes(data, block_size_bytes=256, seed=7)
    h, expected = 7, []
    for start in range(0, len(data) // 256 * 256, 256):  # ASCII: boundaries on the grid
        h = xxhash.xxh3_64_intdigest(data[start:start + 256], h)
        expected.append(h)
    assert hashes == expected and len(hashes) == 39


def test_the_c_loop_refuses_a_block_under_four_bytes_like_the_wrapper() -> None:
    with pytest.raises(ValueError, match="block_size_bytes must be >= 4"):
        chain.block_hashes(b"abcdefgh", 3, 0)
    with pytest.raises(ValueError, match="block_size_bytes must be >= 4"):
        block_hashes(b"abcdefgh", block_size_bytes=3, seed=0)
