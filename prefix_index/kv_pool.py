"""A fleet-shared KV pool in the index: its chains under one pseudo-backend id.

With a KV store every backend shares (Mooncake Store, an LMCache remote backend, Dynamo's
shared tiers; the gateway config's ``kv_pool`` section), each backend writes the blocks it
prefills there and may load any prefix block found there. The index keeps the pool's
residency like a backend's: `KV_POOL_ID` is recorded with every chain a backend prefills and
matched in the same call (one Redis round trip) with a capacity whose blocks are all
"host tier" (loaded before use, never read in place). `with_kv_pool` then gives each backend
the pool's blocks past its own match: a backend can load them, at its pool link's
bandwidth, instead of prefilling them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prefix_index.base import NO_MATCH, BlockMatch, TierCapacity

__all__ = ["KV_POOL_ID", "kv_pool_capacity", "with_kv_pool"]

# Not a valid backend id in the gateway config (ids match [A-Za-z0-9_.-]+), so it cannot clash.
KV_POOL_ID = "@kv-pool"


def kv_pool_capacity(capacity_bytes: float, block_kv_bytes: float) -> TierCapacity:
    """The pool's capacity in index blocks of ``block_kv_bytes`` each, all in the loaded tier.

    Raises:
        ValueError: ``block_kv_bytes`` ≤ 0 or ``capacity_bytes`` < 0.
    """
    if block_kv_bytes <= 0 or capacity_bytes < 0:
        raise ValueError("kv_pool_capacity needs block_kv_bytes > 0 and capacity_bytes >= 0")
    return TierCapacity(0, int(capacity_bytes // block_kv_bytes))


def with_kv_pool(matches: Mapping[str, BlockMatch], backend_ids: Iterable[str]) -> dict[str, BlockMatch]:
    """Each backend's match extended by the pool's (``matches[KV_POOL_ID]``), which is dropped.

    A backend whose own prefix (HBM, host tier, in flight) is shorter than the pool's gets
    the difference as ``kv_pool_blocks``; hashes are chained, so the pool's prefix contains
    the backend's. Without a pool entry the matches are returned as they are (minus it).
    """
    out = {bid: m for bid, m in matches.items() if bid != KV_POOL_ID}
    kv_pool = matches.get(KV_POOL_ID)
    if kv_pool is None or not kv_pool.matched_blocks:
        return out
    depth = kv_pool.matched_blocks
    for bid in backend_ids:
        own = out.get(bid, NO_MATCH)
        if depth > own.matched_blocks:
            out[bid] = BlockMatch(depth, own.hbm_blocks, own.host_blocks, depth - own.matched_blocks,
                                  own.in_flight_blocks)
    return out
