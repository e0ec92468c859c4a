"""In-process prefix index: the embedded default for one gateway instance and the demo.

This module owns :class:`MemoryPrefixIndex`, which implements ``base.PrefixIndex`` under
the semantics in ``base.py``; the contract suite checks it agrees with
``RedisPrefixIndex``. Methods never await, so each runs atomically on the event loop.

Layout: each record of a (model, backend) appends a *segment*, the recorded chain, whose
scores are consecutive and above every older segment's (head highest). A block lives in
the segment that touched it last. Because a chain that contains a block contains every
block before it (hashes are chained), re-touching blocks of an older segment always
stales a prefix of it, and trimming the lowest scores removes a suffix of the oldest
live segment: so each segment's live blocks are one depth range ``[lo, hi)``, and a
block's rank is (live blocks in newer segments, from a Fenwick tree) + (its depth − lo).
A record then costs one dict update per block instead of a sorted-container re-insert
(per-record cost: BENCHMARKS.md, "Prefix index"). The one assumption is that a chain never
repeats a hash, which would take a 64-bit xxh3 collision.

Memory scales with live blocks, not with recorded chains. A segment keeps no reference to
the request's hash list: its hashes are copied into one flat ``array('Q')`` log (8 bytes a
slot, no int objects), and per-segment bookkeeping sits in ``array('q')`` columns. Stale
slots (a prefix re-touched by a newer record, a trimmed tail) and dead segments are
reclaimed by compaction once they outnumber the live ones, so the log never holds more than
twice the live blocks (plus `_LOG_SLACK_MIN_SLOTS`) and segments are renumbered once dead
ones outnumber live ones (plus `_DEAD_SEGMENTS_MIN`), each compaction linear in what is
live and paid for by as many dead entries. Bytes per live block are measured by
``python bench/index_memory.py`` (BENCHMARKS.md, "Prefix index memory").
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Mapping, Sequence

from prefix_index.base import (
    NO_MATCH,
    BlockMatch,
    IndexStats,
    TierCapacity,
    check_hashes,
    match_chain,
)

__all__ = ["ENTRY_INT_BYTES", "MemoryPrefixIndex"]

# The two int objects a held block's dict entry owns on CPython 3.11 (``sys.getsizeof``): the
# 64-bit hash (36 bytes: three 30-bit digits, 32 below 2**60) and its position ``segment << 32 |
# depth`` (32 bytes below 2**60, i.e. a billion segments). `stats` adds these to what it measures
# of the containers (dict tables, arrays).
ENTRY_INT_BYTES = 36 + 32
_DEPTH_BITS = 32
_DEPTH_MASK = (1 << _DEPTH_BITS) - 1
# Compaction floors, so a small index is not rewritten on every record: 4,096 log slots
# (32 KB) and 256 dead segments (8 KB of columns) may always wait.
_LOG_SLACK_MIN_SLOTS = 4096
_DEAD_SEGMENTS_MIN = 256


class _Residency:
    """The blocks of one (model, backend), in record segments (see the module docstring).

    Segment ``k`` is the chain of the k-th record; its blocks at depths ``[lo[k], hi[k])``
    are live (held and last touched by that record), and the block at depth ``d`` sits at
    ``log[start[k] + d]`` (``start`` may be negative once a stale prefix was compacted away).
    ``where[hash]`` is ``k << 32 | depth``. ``_tree`` is a Fenwick tree of live blocks per
    segment, for "how many live blocks are in newer segments" in O(log segments).
    """

    __slots__ = ("where", "log", "start", "lo", "hi", "_tree", "first", "live_segments")

    def __init__(self) -> None:
        self.where: dict[int, int] = {}
        self.log = array("Q")
        self.start = array("q")
        self.lo = array("q")
        self.hi = array("q")
        self._tree = array("q", [0])  # 1-based
        self.first = 0  # oldest segment that may still hold live blocks
        self.live_segments = 0

    def rank(self, block_hash: int) -> int | None:
        """Recency rank: how many held blocks have a higher score (None if not held)."""
        at = self.where.get(block_hash)
        if at is None:
            return None
        k, depth = at >> _DEPTH_BITS, at & _DEPTH_MASK
        return len(self.where) - self._prefix(k + 1) + depth - self.lo[k]

    def ranker(self, chain: Sequence[int]) -> Callable[[int], int | None]:
        """Depth -> rank of ``chain[depth]``, for ``base.match_chain``."""
        return lambda depth: self.rank(chain[depth])

    def touch(self, chain: Sequence[int]) -> None:
        """Make ``chain`` the newest segment: its head the most recent block."""
        where, lo, hi = self.where, self.lo, self.hi
        k_new = len(lo)
        tag = k_new << _DEPTH_BITS
        stale: dict[int, int] = {}  # older segment -> depths [0, n) of it now re-touched
        for depth, block_hash in enumerate(chain):
            at = where.get(block_hash)
            if at is not None:
                stale[at >> _DEPTH_BITS] = (at & _DEPTH_MASK) + 1
            where[block_hash] = tag | depth
        for k, n in stale.items():
            if n > lo[k]:
                moved = min(n, hi[k]) - lo[k]
                lo[k] = n
                if moved > 0:
                    self._add(k + 1, -moved)
                    if hi[k] <= n:
                        self.live_segments -= 1
        self.start.append(len(self.log))
        self.log += array("Q", chain)  # twice as fast as array.extend on a list
        lo.append(0)
        hi.append(len(chain))
        self._append(len(chain))
        self.live_segments += 1

    def trim(self, keep_blocks: int) -> None:
        """Evict the lowest scores (deepest blocks of the oldest segments) until at most
        ``keep_blocks`` remain, then reclaim dead space if it outweighs the live."""
        where, log, start, lo, hi = self.where, self.log, self.start, self.lo, self.hi
        excess = len(where) - keep_blocks
        k = self.first
        while excess > 0:
            live = hi[k] - lo[k]
            if live > 0:
                take = min(live, excess)
                end = start[k] + hi[k]
                for pos in range(end - take, end):
                    del where[log[pos]]
                hi[k] -= take
                self._add(k + 1, -take)
                excess -= take
                if take == live:
                    self.live_segments -= 1
            if hi[k] <= lo[k]:
                k += 1
        while k < len(lo) and hi[k] <= lo[k]:
            k += 1
        self.first = k
        dead_segments = len(lo) - self.live_segments
        if dead_segments > max(self.live_segments, _DEAD_SEGMENTS_MIN):
            self._renumber()
        elif len(log) - len(where) > max(len(where), _LOG_SLACK_MIN_SLOTS):
            self._compact_log()

    def _compact_log(self) -> None:
        """Copy only the live slots into a new log (segment numbers unchanged)."""
        old, start, lo, hi = self.log, self.start, self.lo, self.hi
        log = array("Q")
        for k in range(self.first, len(lo)):
            if hi[k] > lo[k]:
                s = start[k]
                start[k] = len(log) - lo[k]
                log += old[s + lo[k]: s + hi[k]]
        self.log = log

    def _renumber(self) -> None:
        """Drop the dead segments, renumber the live ones in order, rebuild the log and tree."""
        old, start, lo, hi, where = self.log, self.start, self.lo, self.hi, self.where
        log, new_start, new_lo, new_hi = array("Q"), array("q"), array("q"), array("q")
        for k in range(self.first, len(lo)):
            if hi[k] <= lo[k]:
                continue
            tag = len(new_lo) << _DEPTH_BITS
            s = start[k]
            new_start.append(len(log) - lo[k])
            for depth in range(lo[k], hi[k]):
                where[old[s + depth]] = tag | depth
            log += old[s + lo[k]: s + hi[k]]
            new_lo.append(lo[k])
            new_hi.append(hi[k])
        self.log, self.start, self.lo, self.hi = log, new_start, new_lo, new_hi
        self.first, self.live_segments = 0, len(new_lo)
        self._tree = array("q", [0])
        for k in range(len(new_lo)):
            self._append(new_hi[k] - new_lo[k])

    def memory_bytes(self) -> int:
        """Bytes held: the dict and the arrays (``sys.getsizeof``) plus each entry's two ints."""
        containers = (self.where, self.log, self.start, self.lo, self.hi, self._tree)
        return sum(sys.getsizeof(c) for c in containers) + len(self.where) * ENTRY_INT_BYTES

    # Fenwick tree over segments (1-based), growing by appends.
    def _add(self, i: int, delta: int) -> None:
        tree, n = self._tree, len(self._tree) - 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree, total = self._tree, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def _append(self, value: int) -> None:
        i = len(self._tree)
        # node i covers (i - lowbit(i), i]: the new value plus the nodes it spans
        self._tree.append(value + self._prefix(i - 1) - self._prefix(i - (i & -i)))


class MemoryPrefixIndex:
    """``PrefixIndex`` held in this process (lost on restart, not shared by replicas).

    Records are ordered per (model, backend) by their segments; scores are implicit.
    """

    def __init__(self) -> None:
        self._models: dict[str, dict[str, _Residency]] = {}

    async def match(
        self, model: str, hashes: Sequence[int], capacities: Mapping[str, TierCapacity]
    ) -> dict[str, BlockMatch]:
        """`PrefixIndex.match` (`prefix_index.base`), from memory: never IndexUnavailable."""
        check_hashes(hashes)
        backends = self._models.get(model, {})
        out: dict[str, BlockMatch] = {}
        for backend_id, capacity in capacities.items():
            residency = backends.get(backend_id)
            if residency is None or not hashes:
                out[backend_id] = NO_MATCH
                continue
            out[backend_id] = match_chain(len(hashes), residency.ranker(hashes), capacity)
        return out

    async def record(
        self, model: str, backend_id: str, hashes: Sequence[int], capacity: TierCapacity
    ) -> None:
        """Touch the chain on ``backend_id`` (most recent use) and trim to capacity.

        Args:
            model: served model name.
            backend_id: the backend that served the chain.
            hashes: the chain, ints in [0, 2**64); empty is a no-op. Not retained.
            capacity: the backend's capacity; only ``total_blocks`` blocks stay.

        Raises:
            ValueError: a hash outside [0, 2**64).
        """
        check_hashes(hashes)
        if not hashes:
            return
        # Blocks past total_blocks would get the lowest scores and be trimmed at once.
        chain = hashes[: capacity.total_blocks]
        backends = self._models.setdefault(model, {})
        residency = backends.setdefault(backend_id, _Residency())
        residency.touch(chain)
        residency.trim(capacity.total_blocks)
        if not residency.where:  # a zero capacity leaves nothing to keep
            del backends[backend_id]
            if not backends:
                del self._models[model]

    async def forget(self, backend_id: str) -> None:
        """Drop every entry of ``backend_id``, for all models."""
        for model in list(self._models):
            backends = self._models[model]
            backends.pop(backend_id, None)
            if not backends:
                del self._models[model]

    async def stats(self) -> IndexStats:
        """Return blocks per backend (summed over models) and the bytes the index holds.

        ``memory_bytes`` is measured, not estimated per block: each residency's dict and
        arrays (``sys.getsizeof``, so table slack and dead log slots count) plus the two int
        objects of every entry (`ENTRY_INT_BYTES`); within a few percent of tracemalloc
        (``tests/unit/prefix_index/test_memory_index_memory.py``).
        """
        blocks: dict[str, int] = {}
        memory = 0
        for backends in self._models.values():
            for backend_id, residency in backends.items():
                blocks[backend_id] = blocks.get(backend_id, 0) + len(residency.where)
                memory += residency.memory_bytes()
        return IndexStats(blocks_by_backend=blocks, memory_bytes=memory)

    async def aclose(self) -> None:
        """Drop all entries; the index owns no external resources."""
        self._models.clear()
