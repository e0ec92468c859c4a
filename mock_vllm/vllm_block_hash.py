"""vLLM's prefix-cache block hashes, as its KV-cache events name blocks (issue 30).

The mock's own cache keeps its xxh3 chain (`mock_vllm.kv_cache.prompt_block_hashes`); when KV
events are enabled it names each block as vLLM would too, so a subscriber that tokenises a
prompt with the engine's tokenizer finds the engine's own hashes. The rules, from vLLM's
``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``:

* hash function: ``sha256`` (vLLM's default ``--prefix-caching-hash-algo``):
  ``hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()``, 32 bytes.
  (``sha256_cbor`` needs ``cbor2``, which this project does not have: not offered.)
* ``hash_block_tokens``: ``digest_i = sha256((parent, tuple(block_token_ids), extra_keys))``
  where ``parent`` is ``digest_{i-1}``, or ``NONE_HASH`` for the first block.
* ``NONE_HASH`` (``init_none_hash``): ``sha256(seed)`` with ``seed`` = the ``PYTHONHASHSEED``
  string when that is set, else the fixed ``"vllm-none-hash"`` (vLLM's
  ``DEFAULT_NONE_HASH_SEED`` for cryptographic hashes; only xxhash gets a random per-process
  seed). The caller passes the environment's value in; nothing here reads the environment.
* extra keys (``generate_block_hash_extra_keys``): LoRA name, multi-modal ids, ``cache_salt``
  on the first block only (when non-empty), prompt-embeds hashes; the mock has only the salt,
  so block 0 of a salted request has ``(cache_salt,)`` and every other block ``None``.
* published form (``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
  default on): ``int.from_bytes(digest, "big") & (2**64 - 1)``, the digest's last 8 bytes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256`` hash function: SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)``, 32 bytes."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(python_hash_seed: str | None) -> bytes:
    """vLLM's ``NONE_HASH``, the first block's parent: ``sha256_pickle(PYTHONHASHSEED or "vllm-none-hash")``.

    Args:
        python_hash_seed: the engine process's ``PYTHONHASHSEED`` (``None``: unset).
    """
    return sha256_pickle(DEFAULT_NONE_HASH_SEED if python_hash_seed is None else python_hash_seed)


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[str, ...] | None:
    """The extra keys vLLM hashes into block ``block_index`` of a request: ``(cache_salt,)`` on block 0
    of a salted request, else ``None`` (the mock has no LoRA, multi-modal or prompt-embeds inputs)."""
    return (cache_salt,) if block_index == 0 and cache_salt else None


def hash_block_tokens(none_hash_: bytes, parent: bytes | None, block_token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256``: the 32-byte digest of one full block.

    Args:
        none_hash_: `none_hash` of the engine's seed, used when ``parent`` is ``None``.
        parent: the previous block's digest; ``None`` for the first block.
        block_token_ids: the block's token ids (``block_size`` of them).
        extra_keys: `block_extra_keys` of the block.
    """
    return sha256_pickle((parent or none_hash_, tuple(block_token_ids), extra_keys))


def external_block_hash(digest: bytes) -> int:
    """The hash vLLM publishes for a block (``maybe_convert_block_hash``): the digest's low 64 bits, an
    unsigned int in [0, 2**64)."""
    return int.from_bytes(digest, "big") & _LOW_64_BITS


class BlockChain:
    """One request's prompt blocks as vLLM names them; digests are computed on first use, in order.

    Args:
        token_ids: the prompt's token ids (kept by reference, not copied).
        cache_salt: the request's ``cache_salt`` (``None`` or ``""``: none).
        block_size: tokens per block (16 in vLLM and the mock).
        none_hash_: `none_hash` of the engine's seed.
    """

    __slots__ = ("token_ids", "cache_salt", "block_size", "_none_hash", "_digests")

    def __init__(self, token_ids: Sequence[int], cache_salt: str | None, block_size: int, none_hash_: bytes) -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self.block_size = block_size
        self._none_hash = none_hash_
        self._digests: list[bytes] = []

    def digest(self, index: int) -> bytes:
        """The 32-byte digest of full block ``index``. Raises IndexError past the last full block."""
        if (index + 1) * self.block_size > len(self.token_ids) or index < 0:
            raise IndexError(f"block {index} is not a full block of a {len(self.token_ids)}-token prompt")
        digests, size = self._digests, self.block_size
        while len(digests) <= index:
            i = len(digests)
            digests.append(hash_block_tokens(self._none_hash, digests[i - 1] if i else None,
                                             self.token_ids[i * size:(i + 1) * size],
                                             block_extra_keys(i, self.cache_salt)))
        return digests[index]

    def block_tokens(self, start: int, stop: int) -> list[int]:
        """The token ids of blocks ``[start, stop)``, concatenated."""
        return list(self.token_ids[start * self.block_size:stop * self.block_size])
