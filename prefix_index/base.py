"""The prefix index interface and the semantics every implementation shares.

This module owns :class:`PrefixIndex` (the async protocol behind which
``memory_index.MemoryPrefixIndex`` and ``redis_index.RedisPrefixIndex`` sit, as llm-d's
``indexerInterface``), its value types, and the pure match logic both implementations
follow. The contract suite (``tests/contract/test_prefix_index.py``) checks that they agree.

Residency model (DESIGN.md §4). Per (model, backend) the index keeps a recency-ordered set
of block hashes with scores from a *logical* clock, not wall time: a ``record`` of an
n-block chain takes n fresh clock values and gives the block at depth ``d`` the score
``base + (n - 1 - d)``. So within one record ancestors are more recent than descendants,
and any later record is more recent than every earlier one. Because a chained hash names
its whole prefix, every record that touches a block also touches all its ancestors;
hence an ancestor always outranks its descendants, trimming the lowest scores evicts the
deepest blocks first, and the cached blocks of any chain form a prefix. "Is block ``d``
cached" is therefore monotone in ``d`` and the longest match is a binary search.

Tiers. A block's recency rank is the number of that (model, backend)'s blocks with a
higher score (0 = most recent). Rank < ``hbm_blocks`` -> HBM; rank < ``hbm_blocks +
host_blocks`` -> host (offload) tier; beyond -> evicted, i.e. not matched. Within a
matched prefix ranks strictly increase with depth, so the HBM/host split is a second
binary search.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = [
    "HASH_LIMIT",
    "BlockMatch",
    "NO_MATCH",
    "IndexStats",
    "PrefixIndex",
    "TierCapacity",
    "check_hashes",
    "match_chain",
]

HASH_LIMIT = 1 << 64  # hashes are unsigned 64-bit: ints in [0, HASH_LIMIT)


@dataclass(frozen=True, slots=True)
class TierCapacity:
    """How many index blocks one backend can hold, per tier.

    Attributes:
        hbm_blocks: index blocks that fit in GPU memory (HBM), >= 0.
        host_blocks: index blocks that fit in the host-memory offload tier, >= 0.

    Raises:
        ValueError: a negative or non-int field (from ``__post_init__``).
    """

    hbm_blocks: int
    host_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("hbm_blocks", "host_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TierCapacity.{name} must be an int >= 0, got {value!r}")

    @property
    def total_blocks(self) -> int:
        """Blocks held in either tier; a block ranked at or past this is evicted."""
        return self.hbm_blocks + self.host_blocks


class BlockMatch(NamedTuple):
    """The cached prefix of one request's chain on one backend.

    Attributes:
        matched_blocks: length of the longest cached prefix, in blocks from block 0.
        hbm_blocks: how many of those are in HBM (recency rank < HBM capacity).
        host_blocks: how many are in the host tier.
        kv_pool_blocks: how many, past the backend's own, only a fleet-shared KV pool holds
            (`prefix_index.kv_pool`); ``hbm_blocks + host_blocks + kv_pool_blocks == matched_blocks``.
        in_flight_blocks: how many of the leading blocks requests in flight on that backend
            hold (`prefix_index.pending`), ≤ ``hbm_blocks``: KV already charged to them.
    """

    matched_blocks: int
    hbm_blocks: int
    host_blocks: int
    kv_pool_blocks: int = 0
    in_flight_blocks: int = 0


NO_MATCH = BlockMatch(0, 0, 0)


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size, for metrics and the admin endpoint.

    Attributes:
        blocks_by_backend: blocks held per backend id, summed over models; backends
            holding nothing may be absent.
        memory_bytes: memory the index uses, in bytes (an estimate for the in-memory
            index, ``MEMORY USAGE`` summed over the index's keys for Redis).
    """

    blocks_by_backend: dict[str, int]
    memory_bytes: int


@runtime_checkable
class PrefixIndex(Protocol):
    """Where each backend's cached prompt prefixes are believed to be.

    Every method is a coroutine; implementations bound their own latency and raise only
    :class:`prefix_index.errors.PrefixIndexError` subclasses (``IndexUnavailable`` when
    the store fails), plus ``ValueError`` for out-of-range hashes.
    """

    async def match(
        self, model: str, hashes: Sequence[int], capacities: Mapping[str, TierCapacity]
    ) -> dict[str, BlockMatch]:
        """Return each candidate backend's cached prefix of a chain.

        Args:
            model: served model name; entries of other models never match.
            hashes: the request's chain (``hashing.block_hashes``), ints in [0, 2**64).
            capacities: candidate backend id -> its current tier capacity, in blocks.

        Returns:
            One :class:`BlockMatch` per backend id in ``capacities``, in its order
            (all-zero where nothing matches).

        Raises:
            IndexUnavailable: the backing store failed or was too slow.
            ValueError: a hash outside [0, 2**64).
        """
        ...

    async def record(
        self, model: str, backend_id: str, hashes: Sequence[int], capacity: TierCapacity
    ) -> None:
        """Mark a chain as just used on a backend, then trim that backend to capacity.

        Args:
            model: served model name.
            backend_id: the backend that served (and so now caches) the chain.
            hashes: the chain, ints in [0, 2**64); an empty chain is a no-op.
            capacity: the backend's capacity; its (model, backend) set keeps only the
                ``capacity.total_blocks`` most recent blocks.

        Raises:
            IndexUnavailable: the backing store failed or was too slow.
            ValueError: a hash outside [0, 2**64).
        """
        ...

    async def forget(self, backend_id: str) -> None:
        """Drop every entry of ``backend_id``, for all models (restart, cache reset).

        Raises:
            IndexUnavailable: the backing store failed or was too slow.
        """
        ...

    async def stats(self) -> IndexStats:
        """Return block counts per backend and memory use; not for the request path.

        Raises:
            IndexUnavailable: the backing store failed or was too slow.
        """
        ...

    async def aclose(self) -> None:
        """Release what the index owns; it must not be used afterwards."""
        ...


def check_hashes(hashes: Sequence[int]) -> None:
    """Validate a chain's hashes.

    Args:
        hashes: block hashes.

    Raises:
        ValueError: some hash is outside [0, 2**64).
    """
    if hashes and (min(hashes) < 0 or max(hashes) >= HASH_LIMIT):
        raise ValueError("block hashes must be ints in [0, 2**64)")


def match_chain(
    n_blocks: int, rank_of: Callable[[int], int | None], capacity: TierCapacity
) -> BlockMatch:
    """Binary-search one backend's cached prefix of a chain (the shared match logic).

    ``redis_lua.BATCH_LUA`` computes the same function server-side (it probes block 1
    before the whole range, which gives the same answer: see its module docstring).

    Args:
        n_blocks: chain length, in blocks.
        rank_of: depth -> recency rank of that block (0 = most recent), or None when the
            block is not held.
        capacity: the backend's tier capacity, in blocks.

    Returns:
        The longest prefix whose blocks are all held with rank < ``total_blocks``, split
        into HBM (rank < ``hbm_blocks``) and host blocks.
    """
    matched = _longest_held_prefix(min(n_blocks, capacity.total_blocks), capacity.total_blocks, rank_of)
    in_hbm = _longest_held_prefix(min(matched, capacity.hbm_blocks), capacity.hbm_blocks, rank_of)
    return BlockMatch(matched, in_hbm, matched - in_hbm)


def _longest_held_prefix(hi: int, limit: int, rank_of: Callable[[int], int | None]) -> int:
    """Largest m in [0, hi] such that block m-1 is held with rank < ``limit``.

    The predicate is monotone in m: a record touches a whole chain head first, so a block
    always has a higher score (lower rank) than any deeper block of its chain, and a trim
    drops the lowest scores. Two probes settle the common cases before the binary search:
    the whole range held (a repeated prompt), and block 0 missing (a backend that never
    saw this prefix — most of them).
    """

    def held(m: int) -> bool:
        rank = rank_of(m - 1)
        return rank is not None and rank < limit

    if hi == 0 or held(hi):
        return hi
    if not held(1):
        return 0
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
