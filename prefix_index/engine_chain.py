"""The exact index's own hash space: chained xxh3-64 over an engine block's token ids.

vLLM names a KV block by ``sha256(pickle((parent hash or NONE_HASH, tokens, extra_keys)))``
(``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``), where ``NONE_HASH`` comes from
``PYTHONHASHSEED`` or ``os.urandom``: a gateway cannot count on reproducing it. As llm-d's
kv-cache-manager does (``pkg/kvcache/kvblock/token_processor.py`` chains its own FNV hashes over
the token ids a ``BlockStored`` carries, and maps the engine's hashes onto them), the exact index
keeps its own hashes and maps each engine hash onto one::

    h[-1] = engine_chain_seed(model)
    h[i]  = xxh3_64(len(tokens_i) as u32 LE || tokens_i as u32 LE [|| 0xFF || extra_i], seed=h[i-1])

so a request's token ids, cut into the engine's ``block_size`` blocks, give the hashes the
engine's events were mapped to, whatever the engine's own hash function and seed. ``extra_i`` is
the block's ``extra_keys`` entry (vLLM: multimodal identifiers, LoRA name, ``cache_salt`` on the
first block, prompt-embedding hashes) in `canonical_extra`'s encoding, absent when vLLM sent none;
so a salted prefix never shares hashes with the unsalted one. The seed's domain string keeps these
hashes apart from the approximate index's byte-block hashes (`hashing.chain_seed`). Hash function:
xxHash XXH3 64-bit (https://xxhash.com), as in `hashing`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

__all__ = ["TOKEN_ID_LIMIT", "canonical_extra", "engine_chain_seed", "own_chain", "request_chain", "request_extras"]

TOKEN_ID_LIMIT = 1 << 32  # token ids are packed as u32: every vocabulary in use is far below 2**32
_EXTRA_MARK = b"\xff"


def engine_chain_seed(model: str) -> int:
    """The seed of a model's own chains: ``xxh3_64(b"engine-blocks\\x00" + model)``, in [0, 2**64)."""
    return xxh3_64_intdigest(b"engine-blocks\x00" + model.encode("utf-8", "surrogatepass"))


def canonical_extra(entry: object) -> bytes:
    """One block's ``extra_keys`` entry as bytes, injectively: each item tagged with its type and length.

    Args:
        entry: a sequence (vLLM sends a tuple, msgpack gives a list) of str, bytes, int, float, bool,
            None or nested sequences of those.

    Returns:
        ``b"l" + count`` then each item (``s``/``b`` + u32 length + bytes, ``i`` + decimal, ``f`` +
        ``repr``, ``t``/``F`` for booleans, ``n`` for None).

    Raises:
        ValueError: an item of another type (a map, say): the entry cannot be compared with a request's.
    """
    out = bytearray()
    _encode(entry, out)
    return bytes(out)


def _encode(item: object, out: bytearray) -> None:
    if isinstance(item, (list, tuple)):
        out += b"l" + struct.pack("<I", len(item))
        for part in item:
            _encode(part, out)
    elif isinstance(item, str):
        raw = item.encode("utf-8", "surrogatepass")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(item, (bytes, bytearray)):
        out += b"b" + struct.pack("<I", len(item)) + item
    elif item is None:
        out += b"n"
    elif isinstance(item, bool):
        out += b"t" if item else b"F"
    elif isinstance(item, int):
        raw = str(item).encode()
        out += b"i" + struct.pack("<I", len(raw)) + raw
    elif isinstance(item, float):
        raw = repr(item).encode()
        out += b"f" + struct.pack("<I", len(raw)) + raw
    else:
        raise ValueError(f"extra_keys item of type {type(item).__name__} is not a scalar or a sequence")


def request_extras(n_blocks: int, cache_salt: str | None) -> list[bytes | None]:
    """The ``extra_keys`` vLLM gives a text-only request's blocks, in `canonical_extra` form.

    vLLM (``kv_cache_utils.py::generate_block_hash_extra_keys``) puts ``cache_salt`` in the first
    block's extra keys only, and gives a block with no extra keys ``None``. Multimodal and LoRA
    requests have more (their identifiers); this gateway does not compute those, so such blocks
    never match (an under-count, never a false hit).

    Returns:
        ``n_blocks`` entries: ``canonical_extra((cache_salt,))`` first when a salt is given, else None.
    """
    extras: list[bytes | None] = [None] * n_blocks
    if cache_salt and n_blocks:
        extras[0] = canonical_extra((cache_salt,))
    return extras


def own_hash(parent: int, tokens: Sequence[int], extra: bytes | None) -> int:
    """One block's own hash from its parent's (or the chain seed) and its token ids.

    Raises:
        ValueError: a token id outside [0, 2**32).
    """
    try:
        data = struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if extra is not None:
        data += _EXTRA_MARK + extra
    return xxh3_64_intdigest(data, parent)


def own_chain(model: str, token_ids: Sequence[int], block_size_tokens: int, *,
              extras: Sequence[bytes | None] | None = None, parent: int | None = None) -> list[int]:
    """The own hashes of every full engine block of ``token_ids``.

    Args:
        model: the served model (seeds the chain when ``parent`` is None).
        token_ids: the prompt's (or a ``BlockStored``'s) token ids, ints in [0, 2**32).
        block_size_tokens: the engine's block size (the events' ``block_size``), > 0.
        extras: per block, its `canonical_extra` bytes or None; shorter than the block count means
            None for the rest (`request_extras` gives a request's).
        parent: the own hash the first block chains from (a ``BlockStored``'s parent), or None for
            the model's seed.

    Returns:
        ``len(token_ids) // block_size_tokens`` ints in [0, 2**64); a trailing partial block has none
        (vLLM caches full blocks only).

    Raises:
        ValueError: a block size <= 0 or a token id outside [0, 2**32).
    """
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens!r}")
    h = engine_chain_seed(model) if parent is None else parent
    out: list[int] = []
    for i in range(len(token_ids) // block_size_tokens):
        extra = extras[i] if extras is not None and i < len(extras) else None
        h = own_hash(h, token_ids[i * block_size_tokens:(i + 1) * block_size_tokens], extra)
        out.append(h)
    return out


# The last request chain computed: (token_ids, model, block size, cache_salt, chain). A request's chain is
# wanted twice on its routing path, by the exact index's match and by its in-flight credit
# (`gateway.backends.kv_events_fleet.engine_chain_of`), with the same token-id tuple: the second is this.
_last_request_chain: list[tuple[Sequence[int], str, int, str | None, list[int]]] = []


def request_chain(model: str, token_ids: Sequence[int], block_size_tokens: int, cache_salt: str | None) -> list[int]:
    """A request's own chain at ``block_size_tokens`` (`own_chain` with `request_extras`); asked again for the
    same token-id object, model, size and salt, the chain computed last (identity, not equality: a tuple
    held here cannot be another request's). Read-only: the list may be handed out twice.

    Raises:
        ValueError: as `own_chain`.
    """
    last = _last_request_chain[0] if _last_request_chain else None
    if last is not None and last[0] is token_ids and last[1:4] == (model, block_size_tokens, cache_salt):
        return last[4]
    chain = own_chain(model, token_ids, block_size_tokens,
                      extras=request_extras(len(token_ids) // block_size_tokens, cache_salt))
    if isinstance(token_ids, tuple):  # immutable: safe to recognise by identity
        _last_request_chain[:] = [(token_ids, model, block_size_tokens, cache_salt, chain)]
    return chain
