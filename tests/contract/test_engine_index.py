"""One contract suite over the exact, event-fed index: memory and Redis (a real redis-server).

Expected answers are worked out by hand from the rules in ``prefix_index/engine_index.py``:
blocks of 4 tokens, engine hashes chosen by the test (the index never recomputes them), and
own hashes from ``engine_chain.own_chain``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from prefix_index.engine_chain import canonical_extra
from prefix_index.engine_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Tier
from prefix_index.engine_index import ApplyOutcome, EngineIndex, ExactMatch
from prefix_index.engine_memory import MemoryEngineIndex
from prefix_index.engine_redis import RedisEngineIndex
from prefix_index.redis_connect import connect
from tests.contract.index_support import drop_keys

M, B = "m1", "b1"
T = list(range(100, 124))  # 6 blocks of 4 tokens
APPLIED, DUPLICATE, GAP = ApplyOutcome.APPLIED, ApplyOutcome.DUPLICATE, ApplyOutcome.GAP

Factory = Callable[..., EngineIndex]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    """``make_index(cap=...)``: a fresh index of the parametrised kind (Redis ones share a key prefix,
    as replicas on one Redis do)."""
    made: list[EngineIndex] = []
    connection = None
    if request.param == "redis":
        connection = connect(request.getfixturevalue("redis_url"))
        prefix = request.getfixturevalue("key_prefix")

    def make(cap: int = 1 << 20) -> EngineIndex:
        if connection is None:
            index: EngineIndex = MemoryEngineIndex(max_blocks_per_backend=cap)
        else:
            index = RedisEngineIndex(connection.client, key_prefix=prefix, max_blocks_per_backend=cap,
                                     timeout_s=2.0)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.aclose()
    if connection is not None:
        await drop_keys(connection.client, prefix)
        await connection.aclose()


@pytest.fixture
def index(make_index: Factory) -> EngineIndex:
    return make_index()


def stored(hashes: list[int], parent: int | None, first_block: int, *, medium: str = "GPU",
           extra: tuple[bytes | None, ...] | None = None, group_idx: int | None = None) -> BlockStored:
    """Blocks ``first_block ..`` of ``T`` (4 tokens each) under the given engine hashes."""
    tokens = tuple(T[4 * first_block: 4 * (first_block + len(hashes))])
    return BlockStored(tuple(hashes), parent, tokens, 4, medium, None, extra, group_idx)


def ev(ts: float, *events: object) -> EventBatch:
    return EventBatch(ts, tuple(events))  # type: ignore[arg-type]


async def exact(index: EngineIndex, tokens: list[int] = T, **kw: object) -> ExactMatch:
    return (await index.match(M, tokens, {B: 4}, **kw))[B]  # type: ignore[arg-type]


async def test_stored_blocks_match_by_value_and_a_partial_block_never_counts(index: EngineIndex) -> None:
    r = await index.apply(M, B, 0, ev(1.0, stored([11, 12, 13], None, 0)))
    assert (r.outcome, r.counts.stored, r.state.clean, r.state.block_size_tokens) == (APPLIED, 3, True, 4)
    assert r.state.blocks == {Tier.HBM: 3, Tier.HOST: 0} and r.state.engine_blocks == 3
    assert await exact(index) == ExactMatch(3, 0, 4)
    assert (await exact(index)).hbm_tokens == 12
    assert await exact(index, T[:11]) == ExactMatch(2, 0, 4)  # 11 tokens: two full blocks
    assert await exact(index, T[:4] + [1, 2, 3, 4]) == ExactMatch(1, 0, 4)  # diverges in block 1
    assert await exact(index, [9] + T[1:]) == ExactMatch(0, 0, 4)
    assert await index.match("other-model", T, {B: 4}) == {B: ExactMatch(0, 0, 4)}


async def test_a_parent_from_an_earlier_batch_continues_the_chain(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(1.0, stored([11], None, 0)))
    r = await index.apply(M, B, 1, ev(2.0, stored([12, 13], 11, 1)))
    assert r.counts.stored == 2 and await exact(index) == ExactMatch(3, 0, 4)
    r = await index.apply(M, B, 2, ev(3.0, stored([99], 98, 3)))  # parent never seen: not placed
    assert (r.counts.stored, r.counts.orphaned) == (0, 1)
    assert await exact(index) == ExactMatch(3, 0, 4)


async def test_tiers_and_a_missing_middle_block_ends_the_prefix(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(1.0, stored([11, 12, 13], None, 0)))
    await index.apply(M, B, 1, ev(2.0, stored([12, 13], 11, 1, medium="CPU")))  # offloaded copies
    await index.apply(M, B, 2, ev(3.0, BlockRemoved((13,), "GPU")))
    assert await exact(index) == ExactMatch(2, 1, 4)  # 11,12 in HBM; 13 only on the host
    r = await index.apply(M, B, 3, ev(4.0, BlockRemoved((12,), "GPU")))
    assert await exact(index) == ExactMatch(1, 2, 4)
    assert r.state.blocks == {Tier.HBM: 1, Tier.HOST: 2}
    await index.apply(M, B, 4, ev(5.0, BlockRemoved((12,), "CPU")))  # block 1 gone from both tiers
    assert await exact(index) == ExactMatch(1, 0, 4)  # 13 is still held, but after a miss it is no hit
    await index.apply(M, B, 5, ev(6.0, stored([12], 11, 1, medium="CPU"), BlockRemoved((13,), "CPU"),
                                  stored([13], 12, 2)))  # 13 back in HBM only, after the host block 12
    assert await exact(index) == ExactMatch(1, 1, 4)  # vLLM's host lookup starts after its HBM hit
    r = await index.apply(M, B, 6, ev(7.0, BlockRemoved((12, 77), "GPU")))
    assert (r.counts.removed, r.counts.unknown_removed) == (0, 2)


async def test_placeholder_stores_place_known_blocks_by_hash(index: EngineIndex) -> None:
    """The offloading connector's CPU stores carry no tokens (`BlockStored.placeholder`): each block goes to
    the host tier under the own hash its engine hash has; an unknown hash is orphaned; the block size stays."""
    placeholder = BlockStored((12, 13, 99), None, (), 0, "CPU")
    await index.apply(M, B, 0, ev(1.0, stored([11, 12, 13], None, 0)))
    r = await index.apply(M, B, 1, ev(2.0, placeholder, BlockRemoved((13,), "GPU")))
    assert (r.counts.stored, r.counts.orphaned, r.counts.removed) == (2, 1, 1)
    assert (r.state.blocks, r.state.block_size_tokens, r.state.clean) == ({Tier.HBM: 2, Tier.HOST: 2}, 4, True)
    assert await exact(index) == ExactMatch(2, 1, 4)  # 11, 12 in HBM; 13 on the host
    r = await index.apply(M, B, 2, ev(3.0, stored([14], 13, 3), BlockStored((14,), None, (), 0, "CPU")))
    assert r.state.blocks == {Tier.HBM: 3, Tier.HOST: 3}  # a block stored earlier in the same batch
    r = await index.apply(M, B, 3, ev(4.0, AllBlocksCleared(), BlockStored((11,), None, (), 0, "CPU")))
    assert (r.counts.orphaned, r.state.engine_blocks) == (1, 0)  # after a clear, nothing is known


async def test_copies_are_counted_so_one_removal_leaves_the_other(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(1.0, stored([11], None, 0), stored([11], None, 0)))  # two physical copies
    await index.apply(M, B, 1, ev(2.0, BlockRemoved((11,), "GPU")))
    assert await exact(index) == ExactMatch(1, 0, 4)
    r = await index.apply(M, B, 2, ev(3.0, BlockRemoved((11,), "GPU")))
    assert await exact(index) == ExactMatch(0, 0, 4) and r.state.engine_blocks == 0


async def test_apply_once_rules(index: EngineIndex) -> None:
    r = await index.apply(M, B, 3, ev(1.0, stored([11], None, 0)))
    assert (r.outcome, r.state) == (GAP, None)  # an empty state wants seq 0
    assert (await index.apply(M, B, 0, ev(1.0))).outcome == APPLIED
    assert (await index.apply(M, B, 0, ev(1.0))).outcome == DUPLICATE
    r = await index.apply(M, B, 2, ev(3.0, stored([11], None, 0)))
    assert (r.outcome, r.state.last_seq) == (GAP, 0)
    assert (await index.apply(M, B, 1, ev(2.0))).outcome == APPLIED
    assert (await index.apply(M, B, 2, ev(3.0, stored([11], None, 0)))).outcome == APPLIED
    r = await index.apply(M, B, 1, ev(2.0))  # a late copy of an applied batch
    assert (r.outcome, r.restarted, r.state.last_seq) == (DUPLICATE, False, 2)
    assert await exact(index) == ExactMatch(1, 0, 4)


async def test_a_mid_stream_start_is_not_clean_until_all_blocks_cleared(index: EngineIndex) -> None:
    r = await index.apply(M, B, 7, ev(1.0, stored([11], None, 0)), mid_stream_ok=True)
    assert (r.outcome, r.state.clean, r.state.last_seq) == (APPLIED, False, 7)
    r = await index.apply(M, B, 8, ev(2.0, AllBlocksCleared(), stored([21], None, 0)))
    assert (r.state.clean, r.counts.cleared, r.state.engine_blocks) == (True, True, 1)
    assert await exact(index) == ExactMatch(1, 0, 4)


async def test_a_new_stream_clears_the_old_state(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(10.0, stored([11, 12], None, 0)))
    await index.apply(M, B, 1, ev(11.0))
    r = await index.apply(M, B, 0, ev(20.0, stored([31], None, 0)))  # seq back to 0, later ts: restarted
    assert (r.outcome, r.restarted, r.state.clean, r.state.engine_blocks) == (APPLIED, True, True, 1)
    assert r.state.origin_ts == 20.0
    r = await index.apply(M, B, 0, ev(20.0, stored([31], None, 0)))  # the same batch from another replica
    assert (r.outcome, r.restarted) == (DUPLICATE, False)
    r = await index.apply(M, B, 0, ev(30.0))  # again a new stream, whose seq 0 we have
    r = await index.apply(M, B, 0, ev(40.0, stored([41], None, 0)))
    assert r.restarted and await exact(index) == ExactMatch(1, 0, 4)
    r = await index.apply(M, B, 5, ev(2.0, stored([51], None, 0)))  # gap: seq 5 after seq 0
    assert r.outcome == GAP and not r.restarted
    r = await index.apply(M, B, 0, ev(50.0), mid_stream_ok=False)
    assert r.restarted and r.outcome == APPLIED
    r = await index.apply(M, B, 0, ev(60.0))
    r = await index.apply(M, B, 0, ev(10.0))  # an older ts: a duplicate, not a restart
    assert (r.outcome, r.restarted) == (DUPLICATE, False)


async def test_a_new_stream_seen_mid_way_clears_and_asks_for_its_start(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(10.0, stored([11], None, 0)))
    await index.apply(M, B, 1, ev(11.0))
    r = await index.apply(M, B, 1, ev(30.0, stored([61], None, 0)))  # seq 1 of a later stream
    assert (r.outcome, r.restarted, r.state) == (GAP, True, None)
    assert await index.state(M, B) is None and await exact(index) == ExactMatch(0, 0, 4)


async def test_a_lost_batch_advances_and_marks_the_state_not_clean(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(1.0, stored([11], None, 0)))
    r = await index.apply(M, B, 1, ev(2.0, stored([12], 11, 1)), lost=True)
    assert (r.outcome, r.state.last_seq, r.state.clean, r.counts.stored) == (APPLIED, 1, False, 0)
    assert await exact(index) == ExactMatch(1, 0, 4)


async def test_the_cap_refuses_new_blocks_and_marks_the_state_not_clean(make_index: Factory) -> None:
    index = make_index(cap=2)
    r = await index.apply(M, B, 0, ev(1.0, stored([11, 12, 13], None, 0)))
    assert (r.counts.stored, r.counts.over_cap, r.state.clean, r.state.engine_blocks) == (2, 1, False, 2)
    assert await exact(index) == ExactMatch(2, 0, 4)
    r = await index.apply(M, B, 1, ev(2.0, stored([11], None, 0, medium="CPU")))  # a known hash is no new entry
    assert (r.counts.stored, r.counts.over_cap) == (1, 0)


async def test_conditional_and_unconditional_clear(index: EngineIndex) -> None:
    await index.apply(M, B, 0, ev(100.0, stored([11], None, 0)))
    assert not await index.clear(M, B, origin_before_ts=100.0)  # its state began at 100: kept
    assert await index.state(M, B) is not None
    assert await index.clear(M, B, origin_before_ts=100.5)  # an engine started at 100.5 made none of it
    assert await index.state(M, B) is None and not await index.clear(M, B)
    assert (await index.apply(M, B, 4, ev(200.0))).outcome == GAP  # empty again: wants seq 0


async def test_salted_blocks_match_only_the_same_salt(index: EngineIndex) -> None:
    extra = (canonical_extra(("s1",)), None)
    await index.apply(M, B, 0, ev(1.0, stored([11, 12], None, 0, extra=extra)))
    assert await exact(index, cache_salt="s1") == ExactMatch(2, 0, 4)
    assert await exact(index) == ExactMatch(0, 0, 4)
    assert await exact(index, cache_salt="s2") == ExactMatch(0, 0, 4)


async def test_other_groups_and_media_are_skipped(index: EngineIndex) -> None:
    r = await index.apply(M, B, 0, ev(1.0, stored([11], None, 0, group_idx=1), stored([12], None, 0, medium="DISK"),
                                      BlockRemoved((11,), "DISK")))
    assert (r.counts.skipped, r.counts.stored, r.state.engine_blocks) == (3, 0, 0)


async def test_one_call_answers_backends_of_different_block_sizes(index: EngineIndex) -> None:
    await index.apply(M, "b4", 0, ev(1.0, stored([11, 12], None, 0)))
    eight = BlockStored((21,), None, tuple(T[:8]), 8, "CPU")
    await index.apply(M, "b8", 0, ev(1.0, eight))
    got = await index.match(M, T, {"b8": 8, "b4": 4, "none": 4})
    assert list(got) == ["b8", "b4", "none"]
    assert got == {"b8": ExactMatch(0, 1, 8), "b4": ExactMatch(2, 0, 4), "none": ExactMatch(0, 0, 4)}
    assert got["b8"].host_tokens == 8
    assert await index.match(M, T, {}) == {}
    assert (await index.state(M, "b8")).blocks == {Tier.HBM: 0, Tier.HOST: 1}


async def test_replicas_racing_apply_each_batch_exactly_once(make_index: Factory) -> None:
    """Two indexes on one store (for memory: the same object, as two subscribers in one process)."""
    first = make_index()
    second = first if isinstance(first, MemoryEngineIndex) else make_index()
    batches = [ev(float(s + 1), stored([1000 + s], None if s == 0 else 999 + s, s)) for s in range(6)]
    outcomes: list[ApplyOutcome] = []

    async def replica(index: EngineIndex) -> None:
        for seq, batch in enumerate(batches):
            outcomes.append((await index.apply(M, B, seq, batch)).outcome)

    await asyncio.gather(replica(first), replica(second))
    assert outcomes.count(APPLIED) == 6 and outcomes.count(DUPLICATE) == 6
    assert await exact(first) == ExactMatch(6, 0, 4)
