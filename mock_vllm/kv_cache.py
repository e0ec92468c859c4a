"""Paged KV cache with prefix caching and an optional host (CPU offload) tier.

Modelled on vLLM v1's KV cache manager (``vllm/v1/core/kv_cache_manager.py``,
``block_pool.py``): fixed-size blocks; a full block of prompt tokens is named by a chained
hash of its tokens (the first block seeded by ``cache_salt``), so a later request whose
prompt starts with the same tokens finds it; blocks no running request references stay
cached but are free to evict, least recently used first. Evicted blocks go to the host
tier when there is one (LMCache/vLLM offloading-connector style), itself LRU; a prefix hit
there must be loaded back into HBM before use. A `SharedKVPool` models a KV store shared by
the fleet (Mooncake Store, an LMCache remote backend, Dynamo's shared tiers): every block a
prefill completes is written through to it, and any engine sharing it may load a prefix
block it holds itself in neither HBM nor its host tier.

Only counts and hashes are kept, not block ids: nothing here needs to know *where* a block
lives, only whether it is resident, referenced, or free.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import xxhash


class OutOfBlocks(Exception):
    """Not enough free HBM blocks for an allocation (the caller preempts or waits)."""


class CacheListener(Protocol):
    """Told of the cache changes a KV-event publisher reports (`mock_vllm.kv_event_recorder`)."""

    def gpu_evicted(self, block_hash: int, *, to_host: bool) -> None: ...

    def host_dropped(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    h_i = xxh3_64(tokens of block i as uint32, seed=h_{i−1}); h_{−1} = xxh3_64(cache_salt).
    The mock's own hash space, independent of the gateway's (like vLLM's and llm-d's).
    """
    tokens = array("I", token_ids).tobytes()
    stride = 4 * block_size
    h = xxhash.xxh3_64_intdigest((cache_salt or "").encode())
    hashes = []
    for start in range(0, (len(token_ids) // block_size) * stride, stride):
        h = xxhash.xxh3_64_intdigest(tokens[start : start + stride], seed=h)
        hashes.append(h)
    return hashes


class SharedKVPool:
    """A fleet-shared KV store: block hashes, least recently used evicted past ``num_blocks``.

    One object is shared by the engines of a fleet (the mock fleet's servers, the
    simulator's engines); it keeps hashes only, as `PagedKVCache` does. Each cache names its
    blocks in the pool within its model's namespace (``pool_namespace``), so engines of
    different models never hit each other's blocks.

    Args:
        num_blocks: capacity in KV blocks, ≥ 1.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs num_blocks >= 1")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.stored_blocks_total = 0
        self.loaded_blocks_total = 0

    @classmethod
    def with_capacity(cls, capacity_bytes: float, block_bytes: float) -> SharedKVPool:
        """A pool of ``capacity_bytes`` counted in blocks of ``block_bytes`` (one engine
        block's KV: B_kv × block size).

        Raises:
            ValueError: the capacity holds no block.
        """
        num_blocks = int(capacity_bytes // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"a KV pool of {capacity_bytes:,.0f} bytes holds no {block_bytes:,.0f}-byte KV block")
        return cls(num_blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def store(self, block_hash: int) -> None:
        """Write one block (most recent); the least recently used go past capacity."""
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        lru[block_hash] = None
        self.stored_blocks_total += 1
        if len(lru) > self.num_blocks:
            lru.popitem(last=False)

    def load(self, block_hash: int) -> None:
        """An engine read this block (it becomes most recent)."""
        self._lru.move_to_end(block_hash)
        self.loaded_blocks_total += 1

    def touch(self, block_hash: int) -> None:
        """A block in the pool was used again (it becomes most recent); KeyError if absent."""
        self._lru.move_to_end(block_hash)


class PagedKVCache:
    """Block accounting for one engine: HBM blocks (cached, referenced, anonymous, free) and host blocks.

    Args:
        num_gpu_blocks: HBM blocks for KV (vLLM's ``num_gpu_blocks``), ≥ 1.
        num_host_blocks: host-tier blocks (0 = no offloading), ≥ 0.
        kv_pool: a fleet-shared KV pool this cache writes its prefilled blocks to and loads
            misses from (``None``: none).
        pool_namespace: mixed into every hash this cache stores in or looks up from the pool
            (the engine passes a hash of its model's name).
    """

    def __init__(self, num_gpu_blocks: int, num_host_blocks: int = 0, kv_pool: SharedKVPool | None = None,
                 pool_namespace: int = 0) -> None:
        if num_gpu_blocks < 1 or num_host_blocks < 0:
            raise ValueError("num_gpu_blocks must be >= 1 and num_host_blocks >= 0")
        self.num_gpu_blocks = num_gpu_blocks
        self.num_host_blocks = num_host_blocks
        self.kv_pool = kv_pool
        self._ns = pool_namespace
        self._refs: dict[int, int] = {}  # cached (hashed) HBM blocks -> reference count
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with refs 0, LRU first
        self._anonymous = 0  # referenced blocks with no hash (partial or generated tokens)
        self._host: OrderedDict[int, None] = OrderedDict()  # host-tier hashes, LRU first
        # Told of evictions, offloads and resets (`mock_vllm.kv_event_recorder`); None: KV events off.
        self.listener: CacheListener | None = None

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, or cached but unreferenced (evictable)."""
        return self.num_gpu_blocks - len(self._refs) - self._anonymous + len(self._evictable)

    @property
    def usage_ratio(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: 1 − free/total, a fraction in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_gpu_blocks

    def match(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int, int]:
        """Longest cached prefix of ``hashes`` (at most ``max_blocks``): (HBM, host, pool blocks).

        The prefix is contiguous; each block is counted in HBM if resident there, else in
        the host tier, else in the shared pool. Nothing is touched or referenced.
        """
        hbm = host = kv_pool = 0
        refs, local_host, shared, ns = self._refs, self._host, self.kv_pool, self._ns
        for h in hashes[:max_blocks]:
            if h in refs:
                hbm += 1
            elif h in local_host:
                host += 1
            elif shared is not None and h ^ ns in shared:
                kv_pool += 1
            else:
                break
        return hbm, host, kv_pool

    def resident_hashes(self) -> tuple[list[int], list[int]]:
        """The cached blocks now resident: (HBM, host tier), each a list of block hashes (the mock's space),
        HBM in no particular order, the host tier least recently used first. Referenced and evictable HBM
        blocks alike; anonymous blocks (partial or generated tokens) have no hash and are not listed."""
        return list(self._refs), list(self._host)

    def blocks_needed_to_admit(self, hashes: Sequence[int]) -> int:
        """Free blocks that referencing ``hashes`` (a prefix found by `match`) would use up.

        Every block of the prefix that is evictable (cached, unreferenced) stops being free,
        and every host-tier block takes a free block to be loaded into; blocks some running
        request already references cost nothing. So `acquire_cached` followed by
        ``allocate_anonymous(n)`` succeeds exactly when this + n ≤ `num_free_blocks`, which
        lets a scheduler check an admission without touching the cache (vLLM's
        ``allocate_slots`` likewise returns None, changing nothing, when blocks are short).
        """
        refs, evictable = self._refs, self._evictable
        return sum(1 for h in hashes if h not in refs or h in evictable)

    # -- changes -------------------------------------------------------------------------
    def acquire_cached(self, hashes: Sequence[int]) -> list[int]:
        """Reference prefix blocks found by `match`; host-tier and pool ones are loaded into HBM first.

        Returns:
            The positions in ``hashes`` of the blocks loaded into HBM (ascending).

        Raises:
            OutOfBlocks: loading the host-tier blocks needs more free HBM blocks than there are
                (nothing changed).
        """
        refs = self._refs
        loaded = [i for i, h in enumerate(hashes) if h not in refs]
        to_load = [hashes[i] for i in loaded]
        if len(to_load) > self._free_after_protecting(hashes):
            raise OutOfBlocks
        for h in hashes:
            if h in self._refs:
                self._touch_ref(h)
        for h in to_load:  # most recent in the host tier, so evictions below cannot drop them
            if h in self._host:
                self._host.move_to_end(h)
            else:
                self.kv_pool.load(h ^ self._ns)  # type: ignore[union-attr]  # `match` found it there
        for h in to_load:
            self._evict_one_if_needed()
            self._refs[h] = 1
        return loaded

    def allocate_anonymous(self, n: int) -> None:
        """Take ``n`` blocks for tokens that have no hash yet. Raises OutOfBlocks (nothing changed)."""
        if n > self.num_free_blocks:
            raise OutOfBlocks
        never_used = self.num_gpu_blocks - len(self._refs) - self._anonymous
        for _ in range(n - never_used):  # the never-used blocks go first, then LRU evictions
            self._evict_one()
        self._anonymous += n

    def seal(self, block_hash: int) -> bool:
        """An anonymous block became full with known tokens: name it by ``block_hash``.

        Returns False when another request had already cached that block: the anonymous
        block is then released and the cached one referenced instead (vLLM deduplicates).
        """
        self._anonymous -= 1
        if self.kv_pool is not None:
            self.kv_pool.store(block_hash ^ self._ns)  # write-through on prefill (LMCache's store, Mooncake's put)
        if block_hash in self._refs:
            self._touch_ref(block_hash)
            return False
        self._refs[block_hash] = 1
        return True

    def release(self, cached_hashes: Sequence[int], anonymous: int) -> None:
        """Drop a request's references; unreferenced cached blocks become evictable (LRU tail).

        The request's blocks are used again in the pool too, deepest first, so that there as
        here a prefix outlives its extensions (prompt order would make block 0 the pool's
        oldest, and one eviction would strand the rest of the chain), and a prefix every
        request finds in HBM does not age out of the pool.
        """
        self._anonymous -= anonymous
        # vLLM frees in reverse so a request's deeper blocks are evicted before its prefix.
        kv_pool, ns = self.kv_pool, self._ns
        for h in reversed(cached_hashes):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None
            if kv_pool is not None and h ^ ns in kv_pool:
                kv_pool.touch(h ^ ns)

    def reset(self) -> None:
        """Forget every cached block (``POST /reset_prefix_cache``); only valid when none is referenced.

        The shared pool is not this engine's to clear: other engines use it.
        """
        if self._anonymous or len(self._evictable) != len(self._refs):
            raise RuntimeError("reset with referenced blocks")
        self._refs.clear()
        self._evictable.clear()
        self._host.clear()
        if self.listener is not None:
            self.listener.cleared()

    # -- internals -----------------------------------------------------------------------
    def _free_after_protecting(self, hashes: Sequence[int]) -> int:
        protected = sum(1 for h in hashes if h in self._evictable)
        return self.num_free_blocks - protected

    def _touch_ref(self, h: int) -> None:
        if self._refs[h] == 0:
            del self._evictable[h]
        self._refs[h] += 1

    def _evict_one_if_needed(self) -> None:
        """Make one never-used block available, evicting the LRU cached block if none is."""
        if self.num_gpu_blocks - len(self._refs) - self._anonymous > 0:
            return
        self._evict_one()

    def _evict_one(self) -> None:
        """Evict the least recently used unreferenced cached block (to the host tier, if any)."""
        victim, _ = self._evictable.popitem(last=False)
        del self._refs[victim]
        listener = self.listener
        if listener is not None:
            listener.gpu_evicted(victim, to_host=bool(self.num_host_blocks) and victim not in self._host)
        if self.num_host_blocks:
            self._host[victim] = None
            self._host.move_to_end(victim)
            while len(self._host) > self.num_host_blocks:
                dropped, _ = self._host.popitem(last=False)
                if listener is not None:
                    listener.host_dropped(dropped)
