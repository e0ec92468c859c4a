"""The in-memory index's memory follows its live blocks, not the chains recorded (issue 13, item 8).

Measured with tracemalloc, on the workload that exposed it: requests sharing a long prompt
prefix, each recorded on its backend and on the shared KV pool. Before, every recorded
chain was kept whole while any of its blocks was live: a 32 KB shared prefix (128 blocks)
plus one block of its own cost ~3 KB per added live block (~27 KB with a 256 KB prefix),
while ``stats()`` claimed 130 B.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from prefix_index import KV_POOL_ID, MemoryPrefixIndex, TierCapacity
from prefix_index import memory_index
from tests.contract.test_prefix_index import NaiveIndex

ROOMY = TierCapacity(hbm_blocks=1_000_000)
# A held block costs a dict entry with two int objects (~100-140 B, the table's slack
# included) and a log slot (8 B, at most 16 with dead slots awaiting compaction).
MAX_BYTES_PER_LIVE_BLOCK = 300


def _held_bytes() -> int:
    """Bytes traced to the index's code and to this file (the hash ints it creates): not the
    process's whole traced total, which other threads (a server a previous test left winding
    down) can move while a test runs."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, memory_index.__file__), tracemalloc.Filter(True, __file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _fresh(chain: list[int]) -> list[int]:
    """The same hashes as new int objects, as each request's `block_hashes` returns them."""
    return [int.from_bytes(h.to_bytes(8, "little"), "little") for h in chain]


async def test_memory_per_live_block_is_bounded_under_a_shared_prefix() -> None:
    rnd = random.Random(3)
    prefix = [rnd.getrandbits(64) for _ in range(128)]  # a 32 KB system prompt at 256 B per block
    index = MemoryPrefixIndex()
    tracemalloc.start()
    try:
        await index.record("m", "b", _fresh(prefix), ROOMY)
        await index.record("m", KV_POOL_ID, _fresh(prefix), ROOMY)
        base = _held_bytes()
        for _ in range(300):
            chain = _fresh(prefix) + [rnd.getrandbits(64)]
            await index.record("m", "b", chain, ROOMY)
            await index.record("m", KV_POOL_ID, chain, ROOMY)
            del chain
        grown = _held_bytes() - base
        stats = await index.stats()
        traced = _held_bytes()
    finally:
        tracemalloc.stop()
    assert stats.blocks_by_backend == {"b": 428, KV_POOL_ID: 428}
    assert grown / 600 < MAX_BYTES_PER_LIVE_BLOCK  # 600 blocks added (300 on each)
    # stats() measures instead of assuming: an upper bound (ints shared by the backend's and the
    # pool's entries are counted in each), within 1.5x of what is really held.
    assert traced <= stats.memory_bytes <= 1.5 * traced


async def test_re_recording_one_chain_does_not_grow_the_index() -> None:
    """Dead segments behind a long-lived one are reclaimed (before, only leading ones were)."""
    rnd = random.Random(5)
    old_chain = [rnd.getrandbits(64) for _ in range(100)]
    hot_chain = [rnd.getrandbits(64) for _ in range(4)]
    index = MemoryPrefixIndex()
    tracemalloc.start()
    try:
        base = _held_bytes()
        await index.record("m", "b", _fresh(old_chain), ROOMY)
        for _ in range(2000):
            await index.record("m", "b", _fresh(hot_chain), ROOMY)
        held = _held_bytes() - base
    finally:
        tracemalloc.stop()
    assert (await index.stats()).blocks_by_backend == {"b": 104}
    # Log slack (≤ 4,096 slots of 8 B) and ≤ 256 dead segments (32 B each) may wait for compaction.
    assert held < 80_000


@pytest.mark.parametrize("trim_capacity", [TierCapacity(3, 4), TierCapacity(40, 0)], ids=["trimmed", "roomy"])
async def test_compaction_keeps_the_contract(monkeypatch: pytest.MonkeyPatch, trim_capacity: TierCapacity) -> None:
    """With tiny compaction floors (compacting and renumbering on most records), matches still
    agree with the reference model of base.py's semantics."""
    monkeypatch.setattr(memory_index, "_LOG_SLACK_MIN_SLOTS", 4)
    monkeypatch.setattr(memory_index, "_DEAD_SEGMENTS_MIN", 1)
    rnd = random.Random(11)
    documents = [[rnd.getrandbits(64) for _ in range(10)] for _ in range(3)]
    caps = {"b1": trim_capacity, "b2": TierCapacity(5, 2)}
    index, reference = MemoryPrefixIndex(), NaiveIndex()
    for step in range(600):
        doc = rnd.choice(documents)
        query = doc[: rnd.randint(1, len(doc))] + [rnd.getrandbits(64) for _ in range(rnd.randint(0, 2))]
        assert await index.match("m1", query, caps) == reference.match("m1", query, caps), step
        backend_id = rnd.choice(list(caps))
        await index.record("m1", backend_id, query, caps[backend_id])
        reference.record("m1", backend_id, query, caps[backend_id])
    held = {b: len(s) for (_, b), s in reference.sets.items() if s}
    assert (await index.stats()).blocks_by_backend == held
