"""Per-message fingerprints of a chat request's canonical bytes: what prefix invalidation compares.

Chained block hashes (`prefix_index.hashing`) name whole prefixes, so they cannot say which
earlier context a request repeats once its front changed: drop the oldest message and every
later hash changes, and the bytes shift off the block grid. A fingerprint instead hashes each
element of the canonical layout (`prefix_index.canonical`) on its own::

    canonical  = [preamble: FS sections (template fields, tools)] (RS message)*
    elements   = the preamble, when there is one, then each RS-led message, in request order
    hash_i     = xxh3_64(element_i, seed = chain_seed(model, cache_salt))   the index's own seed
    size_i     = the element's canonical bytes (a message's leading RS not counted); tokens ≈ size_i / bytes-per-token

RS (0x1e) starts each message and occurs nowhere else: free text escapes it and canonical JSON
writes it as ``\\u001e``, so splitting on it is exact. The seed keeps models and cache salts
apart, as in the index. ``head`` counts the leading elements that are the preamble or
``system``/``developer`` messages: what a sliding window keeps (LangChain ``trim_messages``
with ``include_system``). `prefix_index.invalidation` compares fingerprints.

Cost: one ``bytes.find`` per element (a ``memchr`` scan) and one xxh3 call per element, over the
canonical bytes in place (a ``memoryview`` slice each: no element is copied). ``bytes.split`` cost
~3× more (its one-byte scan runs at ~3 GB/s, and it copies every element): 12 µs against ~4 µs for
the 2 messages (32 KB) of `bench/overhead.py`'s 8k chat bodies. The gateway runs it off the critical
path (`gateway.invalidation`), but in the same process: ``python bench/invalidation_bench.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from xxhash import xxh3_64_intdigest

from prefix_index.canonical import FIELD, MESSAGE

__all__ = ["MessageFingerprint", "message_fingerprint"]

_MESSAGE = MESSAGE.encode()
_FIELD = FIELD.encode()
_SYSTEM_ROLES = (b"system", b"developer")
_LONGEST_ROLE = max(map(len, _SYSTEM_ROLES))  # a longer role is neither: not copied to compare


@dataclass(frozen=True, slots=True)
class MessageFingerprint:
    """One chat request's elements (module docstring), leading first.

    Attributes:
        hashes: xxh3-64 of each element, seeded by model and salt (ints in [0, 2**64)).
        sizes: each element's canonical bytes, > 0, same length as ``hashes``.
        head: the leading elements that are the preamble or system/developer messages, ≥ 0.
    """

    hashes: tuple[int, ...]
    sizes: tuple[int, ...]
    head: int

    @property
    def total_bytes(self) -> int:
        """Canonical bytes of every element (the request's canonical bytes)."""
        return sum(self.sizes)


def message_fingerprint(canonical: bytes, seed: int) -> MessageFingerprint:
    """Fingerprint the canonical bytes of a chat request (`prefix_index.chat_canonical_bytes`).

    Args:
        canonical: the request's canonical bytes.
        seed: its chain seed (`prefix_index.chain_seed(model, cache_salt)`).

    Returns:
        The fingerprint; an empty preamble is not an element, so a body of N messages without
        tools or template fields has N elements.
    """
    view = memoryview(canonical)
    bounds = []  # (start, end) of each element, the preamble first; a message's leading RS not counted
    start, cut = 0, canonical.find(_MESSAGE)
    while cut >= 0:
        bounds.append((start, cut))
        start, cut = cut + 1, canonical.find(_MESSAGE, cut + 1)
    bounds.append((start, len(canonical)))
    head = 0
    for start, end in bounds[1:]:
        cut = canonical.find(_FIELD, start, end)
        role_end = end if cut < 0 else cut
        if role_end - start > _LONGEST_ROLE or canonical[start:role_end] not in _SYSTEM_ROLES:
            break
        head += 1
    if bounds[0][1] > 0:
        head += 1
    else:
        del bounds[0]
    return MessageFingerprint(tuple([xxh3_64_intdigest(view[start:end], seed) for start, end in bounds]),
                              tuple([end - start for start, end in bounds]), head)
