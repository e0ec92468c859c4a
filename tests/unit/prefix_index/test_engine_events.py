"""vLLM KV-event payloads -> typed events, in both encodings; malformed payloads -> MalformedEvents;
and the own hash space (`engine_chain`) by value."""

from __future__ import annotations

import struct

import msgpack
import pytest
import xxhash

from prefix_index.engine_chain import canonical_extra, engine_chain_seed, own_chain, request_extras
from prefix_index.engine_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvents,
    Tier,
    decode_batch,
    decode_seq,
    encode_seq,
    engine_hash,
    tier_of,
)
from tests.support.kv_events_wire import batch, cleared, removed, stored

TOKENS = list(range(1, 9))  # two blocks of 4


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("batch_form", ["array", "map"])
def test_each_encoding_decodes_to_the_same_events(form: str, batch_form: str) -> None:
    payload = batch(1700000000.5, [stored([11, 12], None, TOKENS, 4, form=form),
                                   removed([11], medium="CPU", form=form), cleared(form=form)],
                    dp_rank=2, batch_form=batch_form)
    got = decode_batch(payload)
    assert got.ts == 1700000000.5 and got.data_parallel_rank == 2 and got.unknown_events == 0
    assert got.events == (BlockStored((11, 12), None, tuple(TOKENS), 4, "GPU"),
                          BlockRemoved((11,), "CPU"), AllBlocksCleared())


def test_a_batch_without_dp_rank_and_the_older_six_field_event() -> None:
    payload = msgpack.packb([2.0, [["BlockStored", [5], 4, [1, 2, 3, 4], 4, None, None]]])
    got = decode_batch(payload)
    assert got.data_parallel_rank is None
    assert got.events == (BlockStored((5,), 4, (1, 2, 3, 4), 4, None),)


def test_digest_hashes_become_their_low_64_bits() -> None:
    digest = bytes(range(32))  # vLLM's 32-byte sha256 digest when int hashes are off
    low = int.from_bytes(bytes(range(24, 32)), "big")
    got = decode_batch(batch(1.0, [stored([digest], digest, [7, 7], 2)]))
    assert got.events[0].block_hashes == (low,) and got.events[0].parent_block_hash == low
    assert engine_hash(-1) == (1 << 64) - 1  # a signed int64 wraps
    assert engine_hash((1 << 64) - 1) == (1 << 64) - 1
    with pytest.raises(MalformedEvents, match="outside 64 bits"):
        engine_hash(1 << 64)


@pytest.mark.parametrize("form", ["map", "array"])
def test_the_offloading_connectors_placeholder_store_decodes(form: str) -> None:
    """vLLM's OffloadingConnector announces a CPU-tier copy as BlockStored(token_ids=[], block_size=0,
    parent None) with the raw 32-byte digest: a placeholder, not a malformed event."""
    digest = bytes(range(32))
    got = decode_batch(batch(1.0, [stored([digest], None, [], 0, medium="CPU", form=form)]))
    event = got.events[0]
    assert event == BlockStored((int.from_bytes(digest[24:], "big"),), None, (), 0, "CPU")
    assert event.placeholder and not BlockStored((1,), None, (5, 6), 2).placeholder


def test_extra_keys_and_the_other_fields() -> None:
    got = decode_batch(batch(1.0, [stored([1, 2], None, TOKENS, 4, lora_name="ad", extra_keys=[["salt"], None],
                                          group_idx=1, medium="cpu")]))
    event = got.events[0]
    assert event.extra_keys == (canonical_extra(("salt",)), None)
    assert (event.lora_name, event.group_idx, event.medium) == ("ad", 1, "cpu")


def test_unknown_event_types_are_counted_not_fatal() -> None:
    got = decode_batch(batch(1.0, [{"type": "SomethingNew", "x": 1}, ["AlsoNew", 3], cleared()]))
    assert got.events == (AllBlocksCleared(),) and got.unknown_events == 2


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb("hello"), "batch must be"),
    (msgpack.packb([1.0, "x", 0]), "numeric ts and a list"),
    (msgpack.packb(["t", [], 0]), "numeric ts"),
    (msgpack.packb([1.0, [7]]), r"events\[0\] is neither"),
    (batch(1.0, [stored([1], None, [1, 2, 3], 4)]), "3 token ids for 1 blocks of 4"),
    (batch(1.0, [stored([1], None, [1, 2], 0)]), "block_size must be a positive int"),
    (batch(1.0, [stored([1], None, [], -1)]), "block_size must be a positive int"),  # no placeholder either
    (batch(1.0, [stored(["x"], None, [1, 2], 2)]), "block hash must be an int or bytes"),
    (batch(1.0, [stored([1.5], None, [1, 2], 2)]), "block hash must be an int or bytes"),
    (batch(1.0, [stored([1], None, [1, -2], 2)]), "token_ids must be"),
    (batch(1.0, [stored([1], None, [1, 2], 2, extra_keys=[["a"], None])]), "one entry per block"),
    (batch(1.0, [stored([1], None, [1, 2], 2, extra_keys=[[{"a": 1}]])]), "extra_keys: extra_keys item of type dict"),
    (batch(1.0, [removed("notalist")]), "block_hashes must be a list"),
    (batch(1.0, [removed([1], medium=5)]), "medium must be a string"),
])
def test_malformed_payloads_raise_a_clear_error(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedEvents, match=message):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq(b"\x00" * 7 + b"\x05") == 5
    assert decode_seq(encode_seq(REPLAY_END_SEQ)) == REPLAY_END_SEQ
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    with pytest.raises(MalformedEvents, match="8 bytes"):
        decode_seq(b"\x01")


def test_media_map_to_tiers() -> None:
    assert [tier_of(m) for m in (None, "GPU", "gpu", "CPU", "DISK")] == [Tier.HBM, Tier.HBM, Tier.HBM, Tier.HOST, None]


def test_own_chain_by_value() -> None:
    seed = xxhash.xxh3_64_intdigest(b"engine-blocks\x00m")
    assert engine_chain_seed("m") == seed
    h0 = xxhash.xxh3_64_intdigest(struct.pack("<5I", 4, 1, 2, 3, 4), seed)
    h1 = xxhash.xxh3_64_intdigest(struct.pack("<5I", 4, 5, 6, 7, 8), h0)
    assert own_chain("m", TOKENS + [9, 9], 4) == [h0, h1]  # the partial block has no hash
    assert own_chain("m", TOKENS[4:], 4, parent=h0) == [h1]  # a BlockStored continuing from its parent
    salted = xxhash.xxh3_64_intdigest(struct.pack("<5I", 4, 1, 2, 3, 4) + b"\xff" + canonical_extra(("s",)), seed)
    assert own_chain("m", TOKENS, 4, extras=request_extras(2, "s"))[0] == salted
    assert canonical_extra(("s",)) == b"l\x01\x00\x00\x00s\x01\x00\x00\x00s"
    assert own_chain("other", TOKENS, 4)[0] != h0
    with pytest.raises(ValueError, match="token ids"):
        own_chain("m", [1 << 32], 1)
