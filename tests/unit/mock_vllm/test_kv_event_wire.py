"""The msgpack shapes of vLLM's KV events, decoded with plain msgpack (``vllm/distributed/kv_events.py``).

Map encoding: msgspec's tagged struct without ``array_like`` (current vLLM), fields equal to their
default omitted. Positional: the same struct with ``array_like`` (vLLM before #42892), trailing
defaults omitted. The batch is ``[ts, events, data_parallel_rank]`` in both.
"""

from __future__ import annotations

import msgpack
import pytest

from mock_vllm.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch, encode_event

DIGEST = bytes(range(32))
GPU_STORED = BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=[1, 2, 3], block_size=16,
                         medium="GPU", extra_keys=[("salt",), None], group_idx=0, kv_cache_spec_kind="full_attention")
CPU_STORED = BlockStored(block_hashes=[DIGEST], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")


@pytest.mark.parametrize(("event", "as_map", "as_array"), [
    (GPU_STORED,
     {"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None, "token_ids": [1, 2, 3],
      "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt"], None],
      "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
     ["BlockStored", [2**64 - 1, 7], None, [1, 2, 3], 16, None, "GPU", None, [["salt"], None], 0, "full_attention"]),
    (CPU_STORED,
     {"type": "BlockStored", "block_hashes": [DIGEST], "parent_block_hash": None, "token_ids": [], "block_size": 0,
      "lora_id": None, "medium": "CPU", "lora_name": None},
     ["BlockStored", [DIGEST], None, [], 0, None, "CPU", None]),
    (BlockRemoved([5], "GPU", 0), {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0},
     ["BlockRemoved", [5], "GPU", 0]),
    (BlockRemoved([DIGEST], "CPU"), {"type": "BlockRemoved", "block_hashes": [DIGEST], "medium": "CPU"},
     ["BlockRemoved", [DIGEST], "CPU"]),
    (AllBlocksCleared(), {"type": "AllBlocksCleared"}, ["AllBlocksCleared"]),
])
def test_both_encodings_decode_to_vllms_shapes(event, as_map, as_array) -> None:
    for encoding, expected in (("map", as_map), ("positional", as_array)):
        decoded = msgpack.unpackb(msgpack.packb(encode_event(event, encoding), use_bin_type=True), raw=False)
        assert decoded == expected, encoding
    assert list(msgpack.unpackb(msgpack.packb(encode_event(event, "map")), raw=False))[0] == "type"  # tag first


def test_batch_is_positional_ts_events_rank_and_hashes_are_uint64_or_bin() -> None:
    payload = encode_batch(1700000000.5, [GPU_STORED, CPU_STORED], "map")
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert (ts, rank, len(events)) == (1700000000.5, 0, 2)
    assert payload[:1] == b"\x93" and payload[1:2] == b"\xcb"  # fixarray(3), then a float64
    assert b"\xcf" + (2**64 - 1).to_bytes(8, "big") in payload  # uint64
    assert b"\xc4\x20" + DIGEST in payload  # bin8 of 32 bytes


def test_unknown_encoding_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV event encoding"):
        encode_event(AllBlocksCleared(), "json")  # type: ignore[arg-type]
