"""The mock's KV events against vLLM's layout, byte for byte, in both encodings (issue 30's Done-when).

The expected bytes are built here by hand, with ``msgpack.packb`` over literal structures written
out from vLLM's class definitions (``vllm/distributed/kv_events.py``; the field list of
``examples/features/kv_events/kv_events_subscriber.py``, "types copied from" that file) and from how
msgspec encodes them:

* ``KVEventBatch`` is ``array_like``: ``[ts, events, data_parallel_rank]``; ``ts`` a float (msgspec
  writes every float as float64, 0xcb), ``data_parallel_rank`` the publisher's rank (0) — not the
  default (None), so present. A capture from vLLM 0.26 (volcano-sh/kthena#1535) reads the same.
* events are tagged structs (tag = the class name) with ``omit_defaults``. The map encoding (current
  vLLM, since vllm-project/vllm#42892): a map, ``"type"`` first, then the fields by name in
  declaration order, a field with a default left out when at its default (None); fields without a
  default (``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name``) always present, even None.
  The positional encoding (``array_like``, older vLLM): ``[tag, field, ...]`` in declaration order,
  only *trailing* fields at their default left out.
* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None
  (newer vLLM adds locality=None last: at its default, so absent either way). ``BlockRemoved``:
  block_hashes, medium, group_idx=None. ``AllBlocksCleared``: no field.
* msgspec picks the smallest int, str, bin, array and map formats, as ``msgpack.packb`` does; ints
  up to 2**64-1 as uint64 (0xcf), ``bytes`` as bin, None as nil, tuples as arrays.

A few messages are also written out byte by byte from the msgpack spec, so that the two encoders'
agreement is itself checked. Then the three ZMQ frames a plain SUB socket receives from a real mock
(and the replay socket's answer) are compared with these bytes.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from mock_vllm.kv_events import KvEventsConfig
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from router.capacity import kv_block_bytes
from router.cost import BackendSpec
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

H1, H2, H3 = 0xFEDCBA9876543210, 17, 2**63  # a uint64, a positive fixint, the top bit set
DIGEST = bytes(range(32))  # an offloading event's raw 32-byte digest
TOKENS = list(range(100, 132))  # two blocks of 16
TS = 1_789_095_808.8378847


def packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# (the mock's event, vLLM's map encoding, vLLM's positional encoding), written out by hand.
CASES = {
    "gpu stored, first blocks": (
        BlockStored([H1, H2], None, TOKENS, 16, "GPU", extra_keys=[None, None], group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None, "token_ids": TOKENS,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        ["BlockStored", [H1, H2], None, TOKENS, 16, None, "GPU", None, [None, None], 0, "full_attention"]),
    "gpu stored, salted, with a parent": (
        BlockStored([H3], H1, TOKENS[:16], 16, "GPU", extra_keys=[("salt-a",)], group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        {"type": "BlockStored", "block_hashes": [H3], "parent_block_hash": H1, "token_ids": TOKENS[:16],
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt-a"]],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        ["BlockStored", [H3], H1, TOKENS[:16], 16, None, "GPU", None, [["salt-a"]], 0, "full_attention"]),
    "a default inside the positional array": (  # extra_keys None between set fields: kept as nil there
        BlockStored([H2], None, TOKENS[:16], 16, "GPU", group_idx=0),
        {"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": None, "token_ids": TOKENS[:16],
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0},
        ["BlockStored", [H2], None, TOKENS[:16], 16, None, "GPU", None, None, 0]),
    "cpu stored (offloading connector)": (
        BlockStored([DIGEST], None, [], 0, "CPU"),
        {"type": "BlockStored", "block_hashes": [DIGEST], "parent_block_hash": None, "token_ids": [],
         "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None},
        ["BlockStored", [DIGEST], None, [], 0, None, "CPU", None]),
    "gpu removed": (
        BlockRemoved([H1], "GPU", group_idx=0),
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0},
        ["BlockRemoved", [H1], "GPU", 0]),
    "cpu removed": (
        BlockRemoved([DIGEST], "CPU"),
        {"type": "BlockRemoved", "block_hashes": [DIGEST], "medium": "CPU"},
        ["BlockRemoved", [DIGEST], "CPU"]),
    "all cleared": (AllBlocksCleared(), {"type": "AllBlocksCleared"}, ["AllBlocksCleared"]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_each_event_is_vllms_bytes(case: str, encoding: str) -> None:
    event, as_map, as_array = CASES[case]
    expected = packb([TS, [as_map if encoding == "map" else as_array], 0])
    assert encode_batch(TS, [event], encoding) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_a_batch_of_every_event_in_order(encoding: str) -> None:
    events = [c[0] for c in CASES.values()]
    expected = packb([TS, [c[1] if encoding == "map" else c[2] for c in CASES.values()], 0])
    assert encode_batch(TS, events, encoding) == expected  # type: ignore[arg-type]


def test_an_integer_clock_still_gives_a_float64_ts() -> None:
    """EventBatch.ts is a float: msgspec writes 1_700_000_000 from time.time() as float64, never an int."""
    payload = encode_batch(1_700_000_000, [AllBlocksCleared()], "map")  # type: ignore[arg-type]
    assert payload == packb([1_700_000_000.0, [{"type": "AllBlocksCleared"}], 0])
    assert payload[:2] == b"\x93\xcb"  # fixarray of 3, then float64 (an int would be 0xce)


def test_msgspecs_format_choices_by_hand() -> None:
    """Whole messages from the msgpack spec, byte by byte: fixarray 0x93, float64 0xcb + 8 bytes
    big-endian, fixmap 0x8N, fixstr 0xaN/0xbN, uint64 0xcf, fixint, nil 0xc0, bin8 0xc4."""
    ts = b"\xcb" + struct.pack(">d", 1.5)
    cleared_map = b"\x93" + ts + b"\x91" + b"\x81\xa4type\xb0AllBlocksCleared" + b"\x00"
    assert encode_batch(1.5, [AllBlocksCleared()], "map") == cleared_map
    removed_array = (b"\x93" + ts + b"\x92"
                     + b"\x94\xacBlockRemoved\x91\xcf" + H1.to_bytes(8, "big") + b"\xa3GPU\x00"
                     + b"\x93\xacBlockRemoved\x91\xc4\x20" + DIGEST + b"\xa3CPU" + b"\x00")
    assert encode_batch(1.5, [BlockRemoved([H1], "GPU", 0), BlockRemoved([DIGEST], "CPU")],
                        "positional") == removed_array
    stored_map = (b"\x93" + ts + b"\x91\x88"
                  + b"\xa4type\xabBlockStored" + b"\xacblock_hashes\x91\x11"
                  + b"\xb1parent_block_hash\xc0" + b"\xa9token_ids\x90" + b"\xaablock_size\x00"
                  + b"\xa7lora_id\xc0" + b"\xa6medium\xa3CPU" + b"\xa9lora_name\xc0" + b"\x00")
    assert encode_batch(1.5, [BlockStored([H2], None, [], 0, "CPU")], "map") == stored_map


# -- the frames a real mock sends ---------------------------------------------------------------

MODEL = "llama-3.1-8b"
TOPIC = "kv@bytes@llama-3.1-8b"
BLOCK = 16
DEADLINE_S = 10.0
PROBE_WAIT_MS = 100
SPEC = BackendSpec(model=default_catalog().model(MODEL), hardware=default_catalog().hw("h100-sxm"))


def vllm_digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM's block digests by its rule: sha256(pickle((parent or sha256(pickle("vllm-none-hash")),
    tuple(block tokens), extra_keys))), extra_keys ``(salt,)`` on block 0 of a salted request."""
    def sha(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        extra = (salt,) if i == 0 and salt else None
        out.append(sha((out[-1] if out else sha("vllm-none-hash"), tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), extra)))
    return out


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


@pytest.fixture(params=["map", "positional"])
def mock(request: pytest.FixtureRequest) -> Iterator[tuple[str, httpx.Client, zmq.Socket, str, str]]:
    """A mock (4 HBM blocks, 2 host blocks) publishing in one encoding; a plain SUB socket on it."""
    config = EngineConfig(num_gpu_blocks_override=4, host_tier_bytes=2 * kv_block_bytes(SPEC, BLOCK))
    events = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", topic=TOPIC, encoding=request.param)
    app = create_app(MockEngine(SPEC, config), served_model_name=MODEL, time_scale=0.01,
                     registry=CollectorRegistry(), kv_events=events)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    try:
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            publisher = app.state.kv_events.publisher
            sub.connect(publisher.endpoint)
            deadline = time.monotonic() + DEADLINE_S
            while not sub.poll(PROBE_WAIT_MS):  # a PUB drops what it sends before the subscription lands
                assert http.post("/reset_prefix_cache").status_code == 200
                assert time.monotonic() < deadline, "no batch reached the subscriber"
            while sub.poll(PROBE_WAIT_MS):
                sub.recv_multipart()
            yield request.param, http, sub, publisher.replay_endpoint, ctx
    finally:
        sub.close()
        ctx.term()


def receive(sub: zmq.Socket) -> tuple[bytes, bytes, bytes, float]:
    """The next message's three frames and the ts inside its payload (to rebuild the expected bytes)."""
    assert sub.poll(DEADLINE_S * 1000), "no batch within the deadline"
    frames = sub.recv_multipart()
    assert len(frames) == 3
    topic, seq, payload = frames
    assert payload[:2] == b"\x93\xcb"  # [ts as float64, ...]
    (ts,) = struct.unpack(">d", payload[2:10])
    assert abs(ts - time.time()) < 60
    return topic, seq, payload, ts


def complete(http: httpx.Client, tokens: list[int], salt: str | None = None) -> None:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_a_real_mocks_frames_are_vllms_bytes(mock: tuple[str, httpx.Client, zmq.Socket, str, str]) -> None:
    encoding, http, sub, replay_endpoint, ctx = mock
    a, b = list(range(1000, 1040)), list(range(2000, 2040))  # 2 full blocks each, 8 tokens over
    a0, a1 = vllm_digests(a, "s1")
    b0, b1 = vllm_digests(b)

    def stored_gpu(hashes: list[int], parent: int | None, tokens: list[int], extra: list) -> object:
        if encoding == "map":
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                    "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": extra,
                    "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        return ["BlockStored", hashes, parent, tokens, 16, None, "GPU", None, extra, 0, "full_attention"]

    complete(http, a, salt="s1")
    topic, seq, payload, ts = receive(sub)
    first_seq = int.from_bytes(seq, "big")
    assert topic == TOPIC.encode() and len(seq) == 8
    assert payload == packb([ts, [stored_gpu([low64(a0), low64(a1)], None, a[:32], [["s1"], None])], 0])

    complete(http, b)  # 4 HBM blocks: the salted request's last block goes to the host tier
    topic, seq, payload, ts = receive(sub)
    assert seq == (first_seq + 1).to_bytes(8, "big")
    if encoding == "map":
        offloaded = [{"type": "BlockStored", "block_hashes": [a1], "parent_block_hash": None, "token_ids": [],
                      "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None},
                     {"type": "BlockRemoved", "block_hashes": [low64(a1)], "medium": "GPU", "group_idx": 0}]
    else:
        offloaded = [["BlockStored", [a1], None, [], 0, None, "CPU", None], ["BlockRemoved", [low64(a1)], "GPU", 0]]
    assert payload == packb([ts, [*offloaded, stored_gpu([low64(b0), low64(b1)], None, b[:32], [None, None])], 0])

    assert http.post("/reset_prefix_cache").status_code == 200
    cleared = {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
    topic, seq, payload, ts = receive(sub)
    assert (seq, payload) == ((first_seq + 2).to_bytes(8, "big"), packb([ts, [cleared], 0]))
    live = [payload]

    dealer = ctx.socket(zmq.DEALER)  # the replay answer carries the very same payload bytes
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart([b"", (first_seq + 2).to_bytes(8, "big")])
        assert dealer.poll(DEADLINE_S * 1000)
        assert dealer.recv_multipart() == [b"", TOPIC.encode(), (first_seq + 2).to_bytes(8, "big"), live[0]]
        assert dealer.poll(DEADLINE_S * 1000)
        assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]  # vLLM's END_SEQ, -1 signed
    finally:
        dealer.close()
