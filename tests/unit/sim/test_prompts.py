"""Simulated prompts: shared hash ids give shared tokens and shared gateway hashes, nothing else does."""

from __future__ import annotations

import pytest

from prefix_index import block_hashes, block_size_bytes, chain_seed, chat_canonical_bytes
from sim.prompts import TEXT_BYTES_PER_TOKEN, canonical_bytes, prepare_trace, token_ids
from sim.traces import TraceRequest

BLOCK_BYTES = block_size_bytes(64, 4.0)
MODEL = "llama-3.1-70b"


def prepare(*requests: TraceRequest):
    return prepare_trace(list(requests), model=MODEL, block_size_bytes=BLOCK_BYTES)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_canonical_bytes_are_the_gateways_for_one_user_message() -> None:
    req = TraceRequest(arrival_s=0.0, input_tokens=700, output_tokens=5, hash_ids=(0, 9))
    data = canonical_bytes(req, 0)
    text = data[len(b"\x1euser\x1fcontent\x1dtext="):].decode()
    assert len(text) == 700 * TEXT_BYTES_PER_TOKEN and text.startswith(" ")
    assert set(text) <= set(" abcdefghijklmnopqrstuvwxyz")
    assert chat_canonical_bytes({"messages": [{"role": "user", "content": text}]}) == data
    (prep,) = prepare(req)
    assert list(prep.hashes) == block_hashes(data, block_size_bytes=BLOCK_BYTES, seed=chain_seed(MODEL, None))
    assert prep.prompt_bytes == len(data) and prep.max_tokens == 5


@pytest.mark.parametrize(("ids_a", "ids_b", "shared_blocks"), [
    ((0, 1, 2), (0, 1, 3), 2),
    ((0, 1, 2), (0, 4, 2), 1),
    ((5, 1), (0, 1), 0),
], ids=["diverge-at-2", "diverge-at-1", "diverge-at-0"])
def test_equal_leading_hash_ids_share_exactly_those_tokens_and_hashes(ids_a, ids_b, shared_blocks) -> None:
    a = TraceRequest(arrival_s=0.0, input_tokens=1_500, output_tokens=1, hash_ids=ids_a)
    b = TraceRequest(arrival_s=1.0, input_tokens=1_400, output_tokens=1, hash_ids=ids_b)
    pa, pb = prepare(a, b)
    ta, tb = token_ids(pa), token_ids(pb)
    assert (len(ta), len(tb)) == (1_500, 1_400)
    assert common_prefix(ta, tb) == 512 * shared_blocks
    # The 19-byte chat header shifts the 256-byte index grid: the last index block that lies
    # wholly inside the shared text is shared, the one straddling the divergence is not.
    shared_bytes = 19 + 512 * TEXT_BYTES_PER_TOKEN * shared_blocks
    assert common_prefix(pa.hashes, pb.hashes) == shared_bytes // BLOCK_BYTES


def test_records_without_hash_ids_share_nothing() -> None:
    a = TraceRequest(arrival_s=0.0, input_tokens=600, output_tokens=0)
    pa, pb = prepare(a, a)
    assert common_prefix(token_ids(pa), token_ids(pb)) < 2
    assert common_prefix(pa.hashes, pb.hashes) == 0
    assert pa.max_tokens == 1  # output 0 asks for one token, as the replayer sends max_tokens ≥ 1


def test_chat_records_are_refused() -> None:
    chat = TraceRequest(arrival_s=0.0, input_tokens=10, output_tokens=1, messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ValueError, match="chat-message records"):
        prepare(chat)
