"""Chained block hashes over canonical prompt bytes.

This module owns how canonical bytes (``canonical.py``) become the block hashes the index
stores. As in vLLM's prefix caching (``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``),
each block's hash covers its parent's hash, so one hash names the whole prefix up to and
including its block and the radix tree stays implicit (DESIGN.md §4)::

    h[-1] = chain_seed(model, cache_salt)
    h[i]  = xxh3_64(block[i], seed=h[i-1])

Only full blocks are hashed (vLLM never caches a partial block). Blocks are cut on a fixed
grid of ``block_size_bytes``; a grid point that falls inside a UTF-8 character moves back
to the character's first byte, so each block decodes on its own and a boundary depends
only on the bytes before it (plus the one at it): a shared prefix gives shared leading
hashes. Hash function: xxHash XXH3 (Collet, https://xxhash.com), 64-bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from xxhash import xxh3_64_intdigest

_block_hashes_c: Callable[[bytes, int, int], list[int]] | None
try:  # the same function in C, where it was built (hot_path; setup.py): ~6x faster at 8k tokens
    from prefix_index._chain import block_hashes as _block_hashes_c
except ImportError:  # not built, or hot_path chose the sources: this module's loop runs
    _block_hashes_c = None

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "MIN_BLOCK_SIZE_BYTES",
    "block_hashes",
    "block_size_bytes",
    "chain_seed",
]

# 64 tokens per index block: a multiple of vLLM's default 16-token KV block and equal to
# the MLA backends' 64 (REFERENCE.md §3), so an index block never splits an engine block
# on those backends; a 128k-token prompt is ~2,000 blocks, which keeps a Redis lookup
# (binary search over the chain) to ~11 probes per backend.
DEFAULT_BLOCK_SIZE_TOKENS = 64

# ~4 bytes of UTF-8 per token: the usual figure for English text with BPE tokenizers
# (OpenAI's "a token is ~4 characters" guidance; Llama-3's 128k vocabulary gives
# ~4.2 bytes/token on English prose). Only a starting point: the gateway calibrates
# bytes/token per model online from backends' ``usage.prompt_tokens``.
BYTES_PER_TOKEN_ESTIMATE = 4.0

# A UTF-8 character is at most 4 bytes, so a boundary moves back at most 3 bytes; blocks
# of at least 4 bytes therefore never become empty.
MIN_BLOCK_SIZE_BYTES = 4
_MAX_BOUNDARY_BACKOFF_BYTES = 3
_CONTINUATION_MASK = 0xC0
_CONTINUATION_BITS = 0x80


def chain_seed(model: str, cache_salt: str | None) -> int:
    """Return the seed of a hash chain: separates models and cache salts.

    Args:
        model: the served model name, as routed on.
        cache_salt: the request's ``cache_salt`` (vLLM requires it non-empty), or None.

    Returns:
        ``xxh3_64(model + "\\x00" + (cache_salt or ""))`` as an int in [0, 2**64).
        The NUL cannot occur in a model name, so (model, salt) pairs never collide by
        concatenation.
    """
    key = f"{model}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return xxh3_64_intdigest(key)


def block_hashes(data: bytes, *, block_size_bytes: int, seed: int) -> list[int]:
    """Return the chained hashes of every full block of ``data``.

    Args:
        data: canonical prompt bytes (UTF-8; other bytes still hash, boundaries then
            follow the grid exactly wherever the 3-byte backoff finds no lead byte).
        block_size_bytes: nominal block length in bytes, >= 4 (``block_size_bytes()``).
        seed: chain seed from :func:`chain_seed`, in [0, 2**64).

    Returns:
        ``len(data) // block_size_bytes`` ints in [0, 2**64); hash ``i`` covers bytes
        ``[0, boundary(i + 1))``, where ``boundary(k)`` is ``k * block_size_bytes``
        moved back to a character start. A trailing partial block has no hash.

    Raises:
        ValueError: ``block_size_bytes`` < 4.

    Runs in C where ``prefix_index._chain`` was built (`hot_path`), else `block_hashes_python`;
    both give the same hashes (tests/unit/prefix_index/test_chain_extension.py).
    """
    if block_size_bytes < MIN_BLOCK_SIZE_BYTES:
        raise ValueError(f"block_size_bytes must be >= {MIN_BLOCK_SIZE_BYTES}, got {block_size_bytes}")
    if _block_hashes_c is not None:
        return _block_hashes_c(data, block_size_bytes, seed)
    return block_hashes_python(data, block_size_bytes, seed)


def block_hashes_python(data: bytes, block_size_bytes: int, seed: int) -> list[int]:
    """`block_hashes`' definition, in Python (arguments as there, unchecked): what runs where
    the C version (``prefix_index/_chain.c``, the same loop) is not built, and what tests
    compare it with."""
    n = len(data)
    view = memoryview(data)
    out: list[int] = []
    append = out.append
    h = seed
    start = 0
    for grid in range(block_size_bytes, n + 1, block_size_bytes):
        end = grid
        if end < n and data[end] & _CONTINUATION_MASK == _CONTINUATION_BITS:
            end = _char_start(data, end)
        h = xxh3_64_intdigest(view[start:end], h)
        append(h)
        start = end
    return out


def block_size_bytes(block_size_tokens: int, bytes_per_token: float) -> int:
    """Convert an index block size in tokens to bytes of canonical text.

    Args:
        block_size_tokens: tokens per index block, > 0 (default
            ``DEFAULT_BLOCK_SIZE_TOKENS``).
        bytes_per_token: estimated UTF-8 bytes per token, finite and > 0 (default
            ``BYTES_PER_TOKEN_ESTIMATE``, calibrated online per model).

    Returns:
        ``round(block_size_tokens * bytes_per_token)`` bytes, >= 4.

    Raises:
        ValueError: a non-positive or non-finite argument, or a product under 4 bytes.
    """
    if isinstance(block_size_tokens, bool) or not isinstance(block_size_tokens, int) or block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be a positive int, got {block_size_tokens!r}")
    if not math.isfinite(bytes_per_token) or bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be finite and > 0, got {bytes_per_token!r}")
    size = round(block_size_tokens * bytes_per_token)
    if size < MIN_BLOCK_SIZE_BYTES:
        raise ValueError(
            f"block of {block_size_tokens} tokens x {bytes_per_token} bytes/token is {size} bytes; "
            f"need >= {MIN_BLOCK_SIZE_BYTES}"
        )
    return size


def _char_start(data: bytes, end: int) -> int:
    """Move ``end`` back over UTF-8 continuation bytes, at most 3 (one character)."""
    for back in range(1, _MAX_BOUNDARY_BACKOFF_BYTES + 1):
        if data[end - back] & _CONTINUATION_MASK != _CONTINUATION_BITS:
            return end - back
    return end  # not UTF-8 here: keep the grid point
