"""Prefix index: canonical bytes, chained block hashes, and where each backend caches them.

Public surface (DESIGN.md §4)::

    canonical   request body -> canonical UTF-8 bytes (chat, completions, cache_salt)
    hashing     bytes -> chained xxh3-64 block hashes, seeded by model and cache_salt
    base        PrefixIndex protocol, TierCapacity, BlockMatch, IndexStats
    memory_index / redis_index   the two implementations (same contract tests)
    redis_connect   redis_url -> client: one server, a Redis Cluster, or a Sentinel set's master
    redis_defaults  the Redis index's defaults (key prefix, timeouts, key TTL), without redis
    pending     chains routed but not yet prefilled, overlaid on the index's matches
    pool        a fleet-shared KV pool's chains (pseudo-backend KV_POOL_ID), overlaid likewise
    breaker     circuit breaker around an index (a frozen Redis is skipped, then probed)
    deadline    a timeout that times the store, not the event loop's stalls
    messages    a chat request's per-message fingerprints (xxh3 of each message's canonical bytes)
    invalidation  prefix invalidation: requests that rewrite the front or middle of an earlier context
    errors      PrefixIndexError tree

Typical request path::

    data = chat_canonical_bytes(body)
    seed = chain_seed(model, cache_salt(body))
    hashes = block_hashes(data, block_size_bytes=size, seed=seed)
    matches = await index.match(model, hashes, capacities)

Importing the package imports neither redis nor a build choice: the Redis implementation is
imported from its modules (``from prefix_index.redis_index import RedisPrefixIndex``) by
those that use it, and the entry points choose compiled or source (`hot_path.select`).
"""

from prefix_index.base import NO_MATCH, BlockMatch, IndexStats, PrefixIndex, TierCapacity
from prefix_index.breaker import BreakerIndex, CircuitBreaker
from prefix_index.canonical import (
    cache_salt,
    chat_canonical_bytes,
    completion_canonical_bytes,
    completion_prompts,
)
from prefix_index.errors import (
    CanonicalizationError,
    IndexCircuitOpen,
    IndexUnavailable,
    NestingTooDeep,
    PrefixIndexError,
)
from prefix_index.hashing import (
    BYTES_PER_TOKEN_ESTIMATE,
    DEFAULT_BLOCK_SIZE_TOKENS,
    block_hashes,
    block_size_bytes,
    chain_seed,
)
from prefix_index.invalidation import CAUSES as INVALIDATION_CAUSES
from prefix_index.invalidation import Finding, InvalidationDetector
from prefix_index.memory_index import MemoryPrefixIndex
from prefix_index.messages import MessageFingerprint, message_fingerprint
from prefix_index.pending import PendingChains
from prefix_index.kv_pool import KV_POOL_ID, kv_pool_capacity, with_kv_pool

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "BlockMatch",
    "BreakerIndex",
    "Finding",
    "INVALIDATION_CAUSES",
    "InvalidationDetector",
    "MessageFingerprint",
    "CanonicalizationError",
    "CircuitBreaker",
    "IndexCircuitOpen",
    "IndexStats",
    "IndexUnavailable",
    "MemoryPrefixIndex",
    "NO_MATCH",
    "NestingTooDeep",
    "KV_POOL_ID",
    "PendingChains",
    "PrefixIndex",
    "PrefixIndexError",
    "TierCapacity",
    "block_hashes",
    "block_size_bytes",
    "cache_salt",
    "chain_seed",
    "chat_canonical_bytes",
    "completion_canonical_bytes",
    "completion_prompts",
    "kv_pool_capacity",
    "message_fingerprint",
    "with_kv_pool",
]
