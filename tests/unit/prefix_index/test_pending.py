"""PendingChains: the chains of requests in flight, overlaid on the index's matches."""

from __future__ import annotations

from prefix_index import BlockMatch, PendingChains, block_hashes, chain_seed

SEED = chain_seed("m", None)


def chain(text: str) -> list[int]:
    return block_hashes(text.encode(), block_size_bytes=4, seed=SEED)


DOC = chain("aaaabbbbccccddddeeeeffff")  # 6 blocks
SHORTER = DOC[:2]


def test_a_chain_in_flight_counts_as_held_in_hbm_on_its_backend_only() -> None:
    pending = PendingChains()
    pending.add("m", "b1", DOC)
    out = pending.overlay("m", DOC, {}, ["b1", "b2"])
    assert out == {"b1": BlockMatch(6, 6, 0, 0, 6), "b2": BlockMatch(0, 0, 0)}
    # another model never shares it
    assert pending.overlay("m2", DOC, {}, ["b1"]) == {"b1": BlockMatch(0, 0, 0)}
    # a longer prompt with the same head matches the pending prefix (binary search)
    longer = chain("aaaabbbbccccddddeeeeffffgggghhhh")
    assert pending.overlay("m", longer, {}, ["b1"])["b1"] == BlockMatch(6, 6, 0, 0, 6)
    # a prompt that diverges after two blocks matches two
    other = chain("aaaabbbbxxxxyyyy")
    assert pending.overlay("m", other, {}, ["b1"])["b1"] == BlockMatch(2, 2, 0, 0, 2)


def test_the_index_match_is_kept_where_it_is_longer_and_promoted_to_hbm_where_pending() -> None:
    pending = PendingChains()
    pending.add("m", "b1", SHORTER)
    index = {"b1": BlockMatch(6, 1, 5), "b2": BlockMatch(4, 0, 4)}
    out = pending.overlay("m", DOC, index, ["b1", "b2"])
    # b1: 6 blocks known to the index, of which the in-flight request pins the first 2 in HBM
    assert out == {"b1": BlockMatch(6, 2, 4, 0, 2), "b2": BlockMatch(4, 0, 4)}


def test_removal_undoes_one_addition_each() -> None:
    pending = PendingChains()
    pending.add("m", "b1", DOC)
    pending.add("m", "b1", SHORTER)
    pending.remove("m", "b1", DOC)
    assert pending.overlay("m", DOC, {}, ["b1"])["b1"] == BlockMatch(2, 2, 0, 0, 2)  # the shorter one still runs
    pending.remove("m", "b1", SHORTER)
    assert pending.overlay("m", DOC, {}, ["b1"])["b1"] == BlockMatch(0, 0, 0)
    assert len(pending) == 0
    pending.remove("m", "b1", SHORTER)  # an extra removal is harmless
    assert len(pending) == 0


def test_blocks_in_flight_are_reported_even_where_the_index_already_has_them_in_hbm() -> None:
    """Their KV is already charged to the request in flight: the router must not charge it twice."""
    pending = PendingChains()
    pending.add("m", "b1", SHORTER)
    out = pending.overlay("m", DOC, {"b1": BlockMatch(6, 6, 0)}, ["b1"])
    assert out["b1"] == BlockMatch(6, 6, 0, 0, 2)
