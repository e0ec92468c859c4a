"""The shared KV pool's overlay on per-backend matches."""

from __future__ import annotations

import pytest

from prefix_index import KV_POOL_ID, BlockMatch, TierCapacity, kv_pool_capacity, with_kv_pool


@pytest.mark.parametrize(("own", "pool", "expected"), [
    (BlockMatch(2, 1, 1), BlockMatch(10, 0, 10), BlockMatch(10, 1, 1, 8)),   # the pool goes deeper
    (None, BlockMatch(10, 0, 10), BlockMatch(10, 0, 0, 10)),                 # nothing of its own
    (BlockMatch(12, 12, 0), BlockMatch(10, 0, 10), BlockMatch(12, 12, 0)),   # its own goes deeper
    (BlockMatch(3, 3, 0), None, BlockMatch(3, 3, 0)),                        # the pool holds nothing
], ids=["pool-deeper", "pool-only", "own-deeper", "no-pool-match"])
def test_each_backend_gets_the_pool_blocks_past_its_own_match(own, pool, expected) -> None:
    matches = {} if own is None else {"a": own}
    if pool is not None:
        matches[KV_POOL_ID] = pool
    out = with_kv_pool(matches, ["a"])
    assert out.get("a", BlockMatch(0, 0, 0)) == expected
    assert KV_POOL_ID not in out


def test_pool_capacity_counts_every_block_as_loaded_not_resident() -> None:
    assert kv_pool_capacity(1000e9, 64 * 327_680) == TierCapacity(0, 47_683)
    with pytest.raises(ValueError):
        kv_pool_capacity(1e9, 0)
