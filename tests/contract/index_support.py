"""What the prefix-index contract tests share: chains of labelled blocks, capacities, the timeout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefix_index import BlockMatch, TierCapacity, block_hashes, chain_seed

BLOCK_BYTES = 16
SEED = chain_seed("m1", None)
ROOMY = TierCapacity(hbm_blocks=1000, host_blocks=1000)
ZERO = BlockMatch(0, 0, 0)
# Generous for a loaded CI machine; the production default (50 ms) is exercised below.
CONTRACT_TIMEOUT_S = 2.0


def chain(labels: Sequence[str]) -> list[int]:
    """Chained hashes of one block per label (labels padded to a full block)."""
    data = b"".join(label.encode().ljust(BLOCK_BYTES, b".")[:BLOCK_BYTES] for label in labels)
    hashes = block_hashes(data, block_size_bytes=BLOCK_BYTES, seed=SEED)
    assert len(hashes) == len(labels)
    return hashes


def labels(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def drop_keys(client: Any, key_prefix: str) -> None:
    """Delete every key under ``key_prefix`` (a test's own keys on the shared redis-server);
    ``client`` is a redis-py asyncio client."""
    keys = [key async for key in client.scan_iter(match=f"{key_prefix}:*")]
    if keys:
        await client.delete(*keys)
