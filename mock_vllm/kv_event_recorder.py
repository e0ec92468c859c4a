"""The engine's KV-cache events, recorded from its real cache state (issue 30).

Pure and clock-free like the engine: `KVEventRecorder` is attached to a `MockEngine` (only when
events are enabled; otherwise nothing here runs) and collects the events vLLM would emit, in the
order the cache changes; the server takes them after each step and publishes them as one batch
(`mock_vllm.kv_events`), as vLLM's scheduler takes its ``kv_event_queue`` once per step.

When vLLM emits what (``vllm/v1/core/block_pool.py``, the ``OffloadingConnector``), and the mock:

* ``BlockStored`` GPU: ``cache_full_blocks`` names newly full blocks of a request, one event per
  call with the blocks' hashes, the parent hash (the block before them, ``None`` for block 0),
  their tokens and per-block extra keys. The mock: prompt blocks a prefill chunk completes, prompt
  blocks a P/D decode pulled, and prefix blocks loaded back into HBM from the host tier or the
  shared pool (vLLM caches externally loaded tokens' blocks the same way), one event per
  contiguous run. vLLM keeps (announces, and later removes) each physical copy when two requests
  compute the same block at once; the mock keeps one copy (``PagedKVCache.seal`` de-duplicates),
  so it announces a block only when it becomes cached, and its one eviction is its one removal
  (announcing the second copy too left the subscriber a copy no event ever removed). vLLM also
  caches full blocks of *generated* tokens; the
  mock does not cache generated tokens (they stay anonymous blocks), so it emits nothing for them.
* ``BlockRemoved`` GPU: one per cached block evicted from HBM (``_maybe_evict_cached_block``).
* ``BlockStored`` / ``BlockRemoved`` CPU: the offloading connector's placeholder events when a
  block enters or leaves the host tier (the mock offloads on eviction; a block loaded back stays
  in the host tier too, so it is stored there once).
* ``AllBlocksCleared``: ``reset_prefix_cache``.
* The fleet-shared pool (`mock_vllm.kv_cache.SharedKVPool`, an LMCache/Mooncake-like store): vLLM
  publishes nothing for an external store (LMCache's connector emits no KV events of its own), so
  neither does the mock.

Memory: the map from the mock's block hashes to vLLM's digests holds only blocks resident in HBM
or the host tier (bounded by their capacities); pending events are taken after every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from mock_vllm.kv_event_wire import (
    FULL_ATTENTION,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from mock_vllm.vllm_block_hash import BlockChain, block_extra_keys, external_block_hash, none_hash

GROUP_IDX = 0  # the mock's one KV-cache group (full attention)


class KVEventRecorder:
    """Collects one engine's KV events; also the `PagedKVCache` listener for evictions and resets.

    Args:
        block_size: the engine's tokens per block.
        python_hash_seed: the engine process's ``PYTHONHASHSEED`` (``None``: unset), for ``NONE_HASH``
            (`mock_vllm.vllm_block_hash.none_hash`).
    """

    def __init__(self, block_size: int, python_hash_seed: str | None = None) -> None:
        self.block_size = block_size
        self._none_hash = none_hash(python_hash_seed)
        self._pending: list[KVEvent] = []
        self._digest_of: dict[int, bytes] = {}  # mock block hash -> vLLM digest, while resident somewhere
        self._in_gpu: set[int] = set()
        self._in_host: set[int] = set()

    # -- engine side -----------------------------------------------------------------------
    def chain(self, token_ids: Sequence[int], cache_salt: str | None) -> BlockChain:
        """A request's blocks as vLLM names them (digests computed when first announced)."""
        return BlockChain(token_ids, cache_salt, self.block_size, self._none_hash)

    def gpu_stored(self, chain: BlockChain, mock_hashes: Sequence[int], start: int, stop: int) -> None:
        """Blocks ``[start, stop)`` of a request became cached in HBM: one ``BlockStored`` GPU event.

        ``mock_hashes`` are the request's block hashes in the mock's own space (``MockEngine``'s
        xxh3 chain), so that evictions, which the cache reports by those, can be named.
        """
        if start >= stop:
            return
        digests = [chain.digest(i) for i in range(start, stop)]
        for i, digest in zip(range(start, stop), digests, strict=True):
            self._digest_of[mock_hashes[i]] = digest
            self._in_gpu.add(mock_hashes[i])
        parent = external_block_hash(chain.digest(start - 1)) if start else None
        self._pending.append(BlockStored(
            block_hashes=[external_block_hash(d) for d in digests], parent_block_hash=parent,
            token_ids=chain.block_tokens(start, stop), block_size=self.block_size, medium=MEDIUM_GPU,
            extra_keys=[block_extra_keys(i, chain.cache_salt) for i in range(start, stop)], group_idx=GROUP_IDX,
            kv_cache_spec_kind=FULL_ATTENTION))

    def gpu_cached(self, chain: BlockChain, mock_hashes: Sequence[int], indexes: Sequence[int]) -> None:
        """Blocks at ``indexes`` (ascending) of a request became cached in HBM (sealed by it, or loaded from the
        host tier or the pool): one ``BlockStored`` GPU event per contiguous run."""
        runs: list[list[int]] = []
        for i in indexes:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self.gpu_stored(chain, mock_hashes, run[0], run[-1] + 1)

    def external_hash(self, mock_hash: int) -> int | None:
        """The hash vLLM would publish for a block the engine holds (its digest's low 64 bits), or None when
        no event has named it (cached before the recorder was attached, or a recorder bug)."""
        digest = self._digest_of.get(mock_hash)
        return None if digest is None else external_block_hash(digest)

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first (the next batch)."""
        events, self._pending = self._pending, []
        return events

    # -- cache listener (`mock_vllm.kv_cache.PagedKVCache.listener`) -----------------------------
    def gpu_evicted(self, mock_hash: int, *, to_host: bool) -> None:
        """A cached block left HBM: ``BlockRemoved`` GPU, after the offloading connector's ``BlockStored``
        CPU when it went to the host tier (``to_host``: it was not there already)."""
        digest = self._digest_of.get(mock_hash)
        self._in_gpu.discard(mock_hash)
        if digest is None:
            return  # cached before this recorder was attached: nobody was told of it
        if to_host:
            self._in_host.add(mock_hash)
            self._pending.append(BlockStored(block_hashes=[digest], parent_block_hash=None, token_ids=[],
                                             block_size=0, medium=MEDIUM_CPU))
        self._pending.append(BlockRemoved(block_hashes=[external_block_hash(digest)], medium=MEDIUM_GPU,
                                          group_idx=GROUP_IDX))
        self._forget_if_gone(mock_hash)

    def host_dropped(self, mock_hash: int) -> None:
        """A block left the host tier: ``BlockRemoved`` CPU."""
        digest = self._digest_of.get(mock_hash)
        if digest is None or mock_hash not in self._in_host:
            return
        self._in_host.discard(mock_hash)
        self._pending.append(BlockRemoved(block_hashes=[digest], medium=MEDIUM_CPU))
        self._forget_if_gone(mock_hash)

    def cleared(self) -> None:
        """The prefix cache (HBM and host tier) was reset: ``AllBlocksCleared``."""
        self._digest_of.clear()
        self._in_gpu.clear()
        self._in_host.clear()
        self._pending.append(AllBlocksCleared())

    def _forget_if_gone(self, mock_hash: int) -> None:
        if mock_hash not in self._in_gpu and mock_hash not in self._in_host:
            self._digest_of.pop(mock_hash, None)
