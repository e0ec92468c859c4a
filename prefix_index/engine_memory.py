"""The exact, event-fed index held in this process (one gateway; lost on restart, not shared).

Implements `engine_index.EngineIndex` under the rules of its module docstring; the contract suite
checks it agrees with `engine_redis.RedisEngineIndex`. No method awaits, so each runs atomically on
the event loop. Per (model, backend): a dict engine hash -> own hash and, per tier, a dict own hash
-> copies held (the own int is shared by the two dicts, and counts are small cached ints). Bytes
per block: BENCHMARKS.md, "Exact index memory" (``python bench/engine_index_memory.py``): ~176 per
block held in HBM, ~229 in both tiers.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from prefix_index.engine_events import EventBatch, Tier
from prefix_index.engine_index import (
    DEFAULT_MAX_BLOCKS_PER_BACKEND,
    ApplyCounts,
    ApplyOutcome,
    ApplyResult,
    Clear,
    EngineState,
    ExactMatch,
    Remove,
    Store,
    block_size_of,
    chains_by_block_size,
    decide,
    plan_ops,
    walk_chain,
)

__all__ = ["MemoryEngineIndex"]


class _Engine:
    """One (model, backend)'s blocks and stream position."""

    __slots__ = ("own_of", "tiers", "last_seq", "last_ts", "origin_ts", "clean", "block_size")

    def __init__(self, seq: int, ts: float) -> None:
        self.own_of: dict[int, int] = {}
        self.tiers: dict[Tier, dict[int, int]] = {Tier.HBM: {}, Tier.HOST: {}}
        self.last_seq, self.last_ts, self.origin_ts = seq, ts, ts
        self.clean = seq == 0
        self.block_size: int | None = None

    def store(self, op: Store, cap: int, counts: ApplyCounts) -> None:
        own = self.own_of.get(op.engine)
        if own is None:
            if len(self.own_of) >= cap:
                counts.over_cap += 1
                self.clean = False
                return
            own = self.own_of[op.engine] = op.own
        tier = self.tiers[op.tier]
        tier[own] = tier.get(own, 0) + 1
        counts.stored += 1

    def remove(self, op: Remove, counts: ApplyCounts) -> None:
        own = self.own_of.get(op.engine)
        tier = self.tiers[op.tier]
        copies = None if own is None else tier.get(own)
        if own is None or not copies:
            counts.unknown_removed += 1
            return
        if copies > 1:
            tier[own] = copies - 1
        else:
            del tier[own]
            if own not in self.tiers[Tier.HBM] and own not in self.tiers[Tier.HOST]:
                del self.own_of[op.engine]
        counts.removed += 1

    def clear(self) -> None:
        self.own_of.clear()
        for tier in self.tiers.values():
            tier.clear()
        self.clean = True

    def snapshot(self) -> EngineState:
        return EngineState(self.last_seq, self.last_ts, self.origin_ts, self.clean, self.block_size,
                           len(self.own_of), {t: len(held) for t, held in self.tiers.items()})

    def memory_bytes(self) -> int:
        """The dicts (``sys.getsizeof``: tables and slack) plus each engine and own hash int object."""
        dicts = sys.getsizeof(self.own_of) + sum(sys.getsizeof(t) for t in self.tiers.values())
        return dicts + sum(sys.getsizeof(e) + sys.getsizeof(o) for e, o in self.own_of.items())


class MemoryEngineIndex:
    """`EngineIndex` in memory.

    Args:
        max_blocks_per_backend: engine blocks held per (model, backend), >= 1; stores past it are
            refused and counted (`engine_index.ApplyCounts.over_cap`).

    Raises:
        ValueError: a cap below 1.
    """

    def __init__(self, *, max_blocks_per_backend: int = DEFAULT_MAX_BLOCKS_PER_BACKEND) -> None:
        if max_blocks_per_backend < 1:
            raise ValueError(f"max_blocks_per_backend must be >= 1, got {max_blocks_per_backend!r}")
        self._cap = max_blocks_per_backend
        self._engines: dict[tuple[str, str], _Engine] = {}

    async def apply(self, model: str, backend_id: str, seq: int, batch: EventBatch, *,
                    mid_stream_ok: bool = False, lost: bool = False) -> ApplyResult:
        """`EngineIndex.apply` in memory: never IndexUnavailable."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        key = (model, backend_id)
        engine = self._engines.get(key)
        restart, ok = decide(engine.last_seq if engine else None, engine.last_ts if engine else 0.0, seq, batch.ts,
                             mid_stream_ok=mid_stream_ok)
        if restart:
            del self._engines[key]
            engine = None
        counts = ApplyCounts()
        if not ok:
            outcome = ApplyOutcome.DUPLICATE if engine is not None and seq <= engine.last_seq else ApplyOutcome.GAP
            return ApplyResult(outcome, restart, engine.snapshot() if engine else None, counts)
        if engine is None:
            engine = self._engines[key] = _Engine(seq, batch.ts)
        if lost:
            engine.clean = False
        else:
            for op in plan_ops(model, batch, engine.own_of.get, counts):
                if isinstance(op, Store):
                    engine.store(op, self._cap, counts)
                elif isinstance(op, Remove):
                    engine.remove(op, counts)
                elif isinstance(op, Clear):
                    engine.clear()
            engine.block_size = block_size_of(batch) or engine.block_size
        engine.last_seq, engine.last_ts = seq, batch.ts
        return ApplyResult(ApplyOutcome.APPLIED, restart, engine.snapshot(), counts)

    async def match(self, model: str, token_ids: Sequence[int], block_sizes: Mapping[str, int], *,
                    cache_salt: str | None = None) -> dict[str, ExactMatch]:
        """`EngineIndex.match` from memory."""
        chains = chains_by_block_size(model, token_ids, block_sizes, cache_salt)
        out: dict[str, ExactMatch] = {}
        for backend_id, size in block_sizes.items():
            engine = self._engines.get((model, backend_id))
            if engine is None:
                out[backend_id] = ExactMatch(0, 0, size)
                continue
            hbm, host = engine.tiers[Tier.HBM], engine.tiers[Tier.HOST]
            out[backend_id] = ExactMatch(*walk_chain(chains[size], hbm.__contains__, host.__contains__), size)
        return out

    async def clear(self, model: str, backend_id: str, *, origin_before_ts: float | None = None) -> bool:
        """`EngineIndex.clear` in memory."""
        engine = self._engines.get((model, backend_id))
        if engine is None or (origin_before_ts is not None and engine.origin_ts >= origin_before_ts):
            return False
        del self._engines[(model, backend_id)]
        return True

    async def state(self, model: str, backend_id: str) -> EngineState | None:
        """`EngineIndex.state` from memory."""
        engine = self._engines.get((model, backend_id))
        return None if engine is None else engine.snapshot()

    def held(self, model: str, backend_id: str) -> dict[Tier, dict[int, int]]:
        """Per tier, engine hash -> copies held, for one (model, backend): what its events said the engine
        holds, by the engine's own hashes (for tests and debugging; empty dicts when nothing is held). From
        another thread: each dict is copied in one step under the GIL, but the copies agree with each other
        only while no batch is being applied (poll until two reads agree)."""
        engine = self._engines.get((model, backend_id))
        if engine is None:
            return {Tier.HBM: {}, Tier.HOST: {}}
        own_of = engine.own_of.copy()
        tiers = {tier: held.copy() for tier, held in engine.tiers.items()}
        return {tier: {e: held[o] for e, o in own_of.items() if o in held} for tier, held in tiers.items()}

    def memory_bytes(self) -> int:
        """Bytes the index's per-block structures hold (see `_Engine.memory_bytes`)."""
        return sum(e.memory_bytes() for e in self._engines.values())

    async def aclose(self) -> None:
        """Drop every entry; nothing external is owned."""
        self._engines.clear()
