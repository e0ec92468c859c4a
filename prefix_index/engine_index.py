"""The exact prefix index fed by vLLM's KV-cache events: its protocol, value types and shared rules.

`EngineIndex` is what `engine_memory.MemoryEngineIndex` and `engine_redis.RedisEngineIndex`
implement; one contract suite (``tests/contract/test_engine_index.py``) runs over both. Where the
approximate index (`base.PrefixIndex`) believes, this one knows: it holds what each engine said it
stored and removed (`engine_events`), mapped into the index's own hash space (`engine_chain`).

State per (model, backend):

- the engine-hash -> own-hash map (a ``BlockRemoved`` and a ``BlockStored``'s parent carry only
  engine hashes), one entry per engine block held in some tier;
- per tier (HBM = vLLM medium ``GPU``, host = ``CPU``) the own hashes resident there, each with a
  count of the engine's copies (vLLM does not de-duplicate cached blocks: one hash can be stored
  twice and removed twice); a hash leaves the tier when its count reaches 0, and an engine hash
  leaves the map when its own hash is in neither tier;
- the stream position: ``last_seq`` and ``last_ts`` of the last batch applied, ``origin_ts`` (the
  ``ts`` of the first batch applied since the state was empty), ``clean``, and the engine's
  ``block_size``.

Apply once (`decide`). A batch carries its backend's sequence number. It is applied only when
``seq == last_seq + 1`` (atomically: in Redis a Lua script checks and applies), so replicas that
each subscribe and each call ``apply`` apply every batch exactly once: the others hear
``duplicate`` (``seq <= last_seq``) or ``gap`` (``seq > last_seq + 1``: missed batches, to replay).
A batch with ``seq <= last_seq`` but a later ``ts`` than the last applied one is a new stream
(the engine restarted, its counter back at 0): the state is cleared first. An empty state takes
seq 0; another seq only with ``mid_stream_ok`` (the caller could not replay from 0).

Clean. The state is ``clean`` — a complete picture of the engine's cache — when it began at the
engine's seq 0 or at an ``AllBlocksCleared``, and no batch was lost since. It is not clean after a
mid-stream start, a lost (malformed) batch, or blocks refused at the cap; only a new clean point
(seq 0 of a new stream, ``AllBlocksCleared``, or `EngineIndex.clear` then a replay from seq 0)
makes it clean again. The gateway routes on exact entries only for a clean backend.

Match rule. A request's token ids are cut into each backend's engine blocks and chained
(`engine_chain.own_chain`). ``hbm_blocks`` is the number of leading blocks resident in HBM;
``host_blocks`` the number of blocks right after those that are resident in the host tier. vLLM
finds its GPU prefix hit first (``find_longest_cache_hit`` stops at the first miss) and its
offloading connector then looks up the host tier from where that hit ended, block by block; so a
block held in neither tier ends the prefix, and so does a block held only in HBM after the HBM
prefix ended — later blocks are not hits even if held. Events of KV-cache groups other than 0 (hybrid models' extra groups) and of media other
than GPU and CPU are skipped (counted).

Placeholders. A ``BlockStored`` without token ids (vLLM's offloading connector copying a block to
its CPU tier: `engine_events.BlockStored.placeholder`) cannot be chained; each of its blocks goes
into the event's tier under the own hash its engine hash already has (from an earlier store with
tokens, in the state or the same batch), and is counted ``orphaned`` when it has none.

Bound. At most ``max_blocks_per_backend`` engine hashes per (model, backend): a store past it is
refused and counted (``over_cap``), and the state stops being clean. The engine's own evictions
keep a clean state far below the cap; the cap only bounds a state that missed removals.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from prefix_index.engine_chain import own_chain, request_chain
from prefix_index.engine_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Tier, tier_of

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_BACKEND", "ApplyCounts", "ApplyOutcome", "ApplyResult", "Clear", "EngineIndex",
    "EngineState", "ExactMatch", "NO_EXACT_MATCH", "Remove", "Store", "block_size_of", "chains_by_block_size",
    "decide", "parents_needed", "plan_ops", "walk_chain",
]

# 2**20 engine blocks per backend: 16.8M tokens at vLLM's 16-token blocks, above an H200's KV
# cache (141 GB / 128 KiB per token (Llama-3.1-8B) ~ 1.1M tokens ~ 69k blocks) plus a 1 TB host
# tier (~8M tokens ~ 500k blocks); a leak bound, not a working size (BENCHMARKS.md: bytes per block).
DEFAULT_MAX_BLOCKS_PER_BACKEND = 1 << 20


class ApplyOutcome(enum.Enum):
    """What `EngineIndex.apply` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq <= last_seq (another replica applied it, or a late copy)
    GAP = "gap"  # seq > last_seq + 1, or an empty state and seq > 0: replay from last_seq + 1


class ExactMatch(NamedTuple):
    """A backend's cached prefix of a request, in engine blocks; tokens = blocks x block size."""

    hbm_blocks: int
    host_blocks: int
    block_size_tokens: int

    @property
    def matched_blocks(self) -> int:
        return self.hbm_blocks + self.host_blocks

    @property
    def hbm_tokens(self) -> int:
        return self.hbm_blocks * self.block_size_tokens

    @property
    def host_tokens(self) -> int:
        return self.host_blocks * self.block_size_tokens


NO_EXACT_MATCH = ExactMatch(0, 0, 0)


@dataclass(frozen=True, slots=True)
class EngineState:
    """One (model, backend)'s stream position and size. ``blocks``: distinct own hashes per tier."""

    last_seq: int
    last_ts: float
    origin_ts: float
    clean: bool
    block_size_tokens: int | None
    engine_blocks: int
    blocks: Mapping[Tier, int] = field(default_factory=dict)


@dataclass(slots=True)
class ApplyCounts:
    """What an applied batch did: blocks stored and removed, and what was refused or skipped."""

    stored: int = 0
    removed: int = 0
    over_cap: int = 0  # stores refused at max_blocks_per_backend
    orphaned: int = 0  # stores whose parent's engine hash (a placeholder's: its own) was unknown: not placed
    unknown_removed: int = 0  # removals of an engine hash (or tier) the state does not hold
    skipped: int = 0  # events of another KV-cache group or medium, and unknown event types
    cleared: bool = False  # an AllBlocksCleared was applied


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """`EngineIndex.apply`'s answer. ``state`` is None only when the state is empty (after a gap)."""

    outcome: ApplyOutcome
    restarted: bool  # a new stream was seen: the state was cleared first
    state: EngineState | None
    counts: ApplyCounts


@dataclass(frozen=True, slots=True)
class Store:
    tier: Tier
    engine: int
    own: int


@dataclass(frozen=True, slots=True)
class Remove:
    tier: Tier
    engine: int


@dataclass(frozen=True, slots=True)
class Clear:
    pass


Op = Store | Remove | Clear


@runtime_checkable
class EngineIndex(Protocol):
    """Where each engine's KV blocks are, as its events say. Methods raise only `errors.PrefixIndexError`
    subclasses (``IndexUnavailable`` when the store fails) and ``ValueError`` for bad arguments."""

    async def apply(self, model: str, backend_id: str, seq: int, batch: EventBatch, *,
                    mid_stream_ok: bool = False, lost: bool = False) -> ApplyResult:
        """Apply one batch if it is the next (see the module docstring's rules), atomically.

        Args:
            model, backend_id: whose engine published it.
            seq: its sequence number, >= 0.
            batch: the decoded batch (`engine_events.decode_batch`).
            mid_stream_ok: an empty state may start at this ``seq`` > 0 (not clean).
            lost: the batch could not be decoded: advance ``last_seq`` past it, apply nothing, and
                mark the state not clean (``batch`` gives only its ``ts``).
        """
        ...

    async def match(self, model: str, token_ids: Sequence[int], block_sizes: Mapping[str, int], *,
                    cache_salt: str | None = None) -> dict[str, ExactMatch]:
        """Each candidate backend's cached prefix of ``token_ids`` (one round trip for all).

        Args:
            block_sizes: candidate backend id -> its engine block size in tokens (> 0).
            cache_salt: the request's ``cache_salt`` (vLLM folds it into the first block's hash).

        Returns:
            One `ExactMatch` per backend in ``block_sizes``, in its order (`NO_EXACT_MATCH`'s
            counts with the backend's block size where nothing is held).
        """
        ...

    async def clear(self, model: str, backend_id: str, *, origin_before_ts: float | None = None) -> bool:
        """Drop the backend's entries and stream position; with ``origin_before_ts``, only if its state
        began before then (an engine that started at that wall time cannot have made it). True if dropped."""
        ...

    async def state(self, model: str, backend_id: str) -> EngineState | None:
        """The backend's stream position and block counts, or None when empty."""
        ...

    async def aclose(self) -> None:
        """Release what the index owns."""
        ...


def decide(last_seq: int | None, last_ts: float, seq: int, ts: float, *, mid_stream_ok: bool) -> tuple[bool, bool]:
    """The apply-once rule: ``(restart, apply)`` for a batch ``(seq, ts)`` against the state's position.

    ``restart``: the batch is a new stream's (``seq <= last_seq`` with a later ``ts``), so the state
    is cleared before ``apply`` is decided again against the empty state. ``apply`` False with
    ``seq <= last_seq``: a duplicate; otherwise a gap.
    """
    if last_seq is not None and seq <= last_seq:
        if ts > last_ts:
            return True, seq == 0 or mid_stream_ok
        return False, False
    if last_seq is None:
        return False, seq == 0 or mid_stream_ok
    return False, seq == last_seq + 1


def parents_needed(batch: EventBatch) -> set[int]:
    """Engine hashes of ``BlockStored`` parents, and of placeholder stores' blocks, that the batch does not
    itself store with their tokens (their own hashes are looked up first)."""
    seen: set[int] = set()
    needed: set[int] = set()
    for event in batch.events:
        if isinstance(event, BlockStored) and _indexed(event.group_idx, event.medium):
            if event.placeholder:
                needed.update(h for h in event.block_hashes if h not in seen)
                continue
            if event.parent_block_hash is not None and event.parent_block_hash not in seen:
                needed.add(event.parent_block_hash)
            seen.update(event.block_hashes)
    return needed


def plan_ops(model: str, batch: EventBatch, parent_own: Callable[[int], int | None],
             counts: ApplyCounts) -> list[Op]:
    """The batch as store operations, own hashes computed (`engine_chain.own_chain`).

    Args:
        parent_own: an engine hash -> its own hash in the state before the batch, or None.
        counts: ``orphaned``, ``skipped`` and ``cleared`` are counted here.
    """
    local: dict[int, int] = {}
    after_clear = False
    ops: list[Op] = []
    counts.skipped += batch.unknown_events
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            ops.append(Clear())
            local.clear()
            after_clear = counts.cleared = True
            continue
        tier = tier_of(event.medium)
        if tier is None or not _indexed(event.group_idx, event.medium):
            counts.skipped += 1
        elif isinstance(event, BlockRemoved):
            ops.extend(Remove(tier, h) for h in event.block_hashes)
        elif event.placeholder:  # by hash alone: placed where the state (or this batch) already chained it
            for engine in event.block_hashes:
                own = local.get(engine)
                if own is None and not after_clear:
                    own = parent_own(engine)
                if own is None:
                    counts.orphaned += 1
                else:
                    ops.append(Store(tier, engine, own))
        else:
            parent = event.parent_block_hash
            parent_hash = None if parent is None else local.get(parent)
            if parent is not None and parent_hash is None and not after_clear:
                parent_hash = parent_own(parent)
            if parent is not None and parent_hash is None:
                counts.orphaned += len(event.block_hashes)
                continue
            chain = own_chain(model, event.token_ids, event.block_size, extras=event.extra_keys, parent=parent_hash)
            for engine, own in zip(event.block_hashes, chain):
                local[engine] = own
                ops.append(Store(tier, engine, own))
    return ops


def block_size_of(batch: EventBatch) -> int | None:
    """The engine block size the batch's indexed ``BlockStored`` events name (the last one), or None."""
    size = None
    for event in batch.events:
        if isinstance(event, BlockStored) and _indexed(event.group_idx, event.medium) and not event.placeholder:
            size = event.block_size
    return size


def _indexed(group_idx: int | None, medium: str | None) -> bool:
    return (group_idx is None or group_idx == 0) and tier_of(medium) is not None


def chains_by_block_size(model: str, token_ids: Sequence[int], block_sizes: Mapping[str, int],
                         cache_salt: str | None) -> dict[int, list[int]]:
    """One own chain of ``token_ids`` per distinct block size among the candidates.

    Raises:
        ValueError: a block size <= 0 or a token id outside [0, 2**32).
    """
    chains: dict[int, list[int]] = {}
    for size in set(block_sizes.values()):
        if size <= 0:
            raise ValueError(f"block sizes must be > 0, got {size!r}")
        chains[size] = request_chain(model, token_ids, size, cache_salt)
    return chains


def walk_chain(chain: Sequence[int], in_hbm: Callable[[int], bool], in_host: Callable[[int], bool]) -> tuple[int, int]:
    """``(hbm_blocks, host_blocks)`` of a chain under the match rule (module docstring): leading blocks in
    HBM, then the blocks after them in the host tier; ``engine_lua.MATCH_LUA`` walks the same way."""
    hbm = 0
    while hbm < len(chain) and in_hbm(chain[hbm]):
        hbm += 1
    host = hbm
    while host < len(chain) and in_host(chain[host]):
        host += 1
    return hbm, host - hbm
