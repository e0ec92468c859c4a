"""The mock's KV-event publisher over real sockets: a uvicorn mock on 127.0.0.1 and ZMQ SUB/DEALER peers.

The engine has 4 HBM blocks and a 2-block host tier, so evictions and offloads happen on demand.
Prompts are token ids (they bypass the tokenizer), so expected hashes follow from vLLM's rule
alone: sha256 of the pickled ``(parent, tokens, extra_keys)``, ``NONE_HASH`` = sha256 of the pickled
``"vllm-none-hash"``, low 64 bits published. Every test starts by resetting the cache until its
subscriber sees the ``AllBlocksCleared`` (a PUB drops what it sends before a subscription lands), so
it starts from an empty cache and knows the stream's next sequence number.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.kv_events import END_SEQ, KvEventsConfig
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from router.capacity import kv_block_bytes
from router.cost import BackendSpec
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
TOPIC = "kv@mock@llama-3.1-8b"
BLOCK = 16
TIME_SCALE = 0.01
DEADLINE_S = 10.0
PROBE_WAIT_MS = 100
FAULTS = "/kappa/faults/kv_events"
SPEC = BackendSpec(model=default_catalog().model(MODEL), hardware=default_catalog().hw("h100-sxm"))


def sha(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def digests(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        out.append(sha((out[-1] if out else sha("vllm-none-hash"), tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), None)))
    return out


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def prompt(n: int) -> list[int]:
    rng = random.Random(time.monotonic_ns())
    return [rng.randrange(10, 100_000) for _ in range(n)]


@dataclass
class Mock:
    http: httpx.Client
    sub: zmq.Socket
    replay_endpoint: str
    ctx: zmq.Context

    def complete(self, tokens: list[int]) -> None:
        r = self.http.post("/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text

    def receive(self) -> tuple[bytes, int, list]:
        """The next batch: (topic, seq, events), within the deadline."""
        assert self.sub.poll(DEADLINE_S * 1000), "no KV-event batch within the deadline"
        topic, seq, payload = self.sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert len(seq) == 8 and rank == 0 and abs(ts - time.time()) < 60
        return topic, int.from_bytes(seq, "big"), events

    def sync(self) -> int:
        """Reset the cache until the subscriber sees that batch; returns the next sequence number."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert self.http.post("/reset_prefix_cache").status_code == 200
            if self.sub.poll(PROBE_WAIT_MS):  # a probe, not a readiness guess: repeated until seen
                break
            assert time.monotonic() < deadline, "the subscriber never received a batch"
        while self.sub.poll(PROBE_WAIT_MS):  # the probes that also arrived
            _, seq, events = self.receive()
            assert events in ([{"type": "AllBlocksCleared"}], [["AllBlocksCleared"]])  # map / positional
        return seq + 1

    def replay(self, start_seq: int) -> list[tuple[bytes, int, bytes]]:
        """vLLM's replay protocol from a DEALER: [b"", start_seq] out, [b"", topic, seq, payload]... back."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(DEADLINE_S * 1000), "replay did not end within the deadline"
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close()


def serve(encoding: str) -> Iterator[Mock]:
    config = EngineConfig(num_gpu_blocks_override=4, host_tier_bytes=2 * kv_block_bytes(SPEC, BLOCK))
    events = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", topic=TOPIC, buffer_steps=64, encoding=encoding)
    app = create_app(MockEngine(SPEC, config), served_model_name=MODEL, time_scale=TIME_SCALE,
                     registry=CollectorRegistry(), kv_events=events)
    ctx = zmq.Context()
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        publisher = app.state.kv_events.publisher
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(publisher.endpoint)
        try:
            yield Mock(http, sub, publisher.replay_endpoint, ctx)
        finally:
            sub.close()
    ctx.term()


@pytest.fixture(scope="module")
def mock() -> Iterator[Mock]:
    yield from serve("map")


def test_block_stored_names_a_requests_full_blocks_by_vllms_hashes(mock: Mock) -> None:
    seq0 = mock.sync()
    tokens = prompt(40)
    mock.complete(tokens)
    topic, seq, events = mock.receive()
    d0, d1 = digests(tokens)
    assert (topic, seq) == (TOPIC.encode(), seq0)
    assert events == [{"type": "BlockStored", "block_hashes": [low64(d0), low64(d1)], "parent_block_hash": None,
                       "token_ids": tokens[:32], "block_size": 16, "lora_id": None, "medium": "GPU",
                       "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                       "kv_cache_spec_kind": "full_attention"}]


def test_eviction_offload_and_reload_as_gpu_and_cpu_events(mock: Mock) -> None:
    mock.sync()
    a, b = prompt(40), prompt(48)
    a0, a1 = digests(a)
    b0, b1, b2 = digests(b)
    mock.complete(a)
    assert [e["block_hashes"] for e in mock.receive()[2]] == [[low64(a0), low64(a1)]]
    mock.complete(b)  # a1 is evicted from HBM into the host tier
    events = mock.receive()[2]
    assert events[:2] == [{"type": "BlockStored", "block_hashes": [a1], "parent_block_hash": None, "token_ids": [],
                           "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None},
                          {"type": "BlockRemoved", "block_hashes": [low64(a1)], "medium": "GPU", "group_idx": 0}]
    assert events[2]["block_hashes"] == [low64(b0), low64(b1), low64(b2)] and len(events) == 3
    mock.complete(a)  # a1 comes back from the host tier (b2 offloaded), then b1 offloaded pushes a1 out of it
    stored = [(e["medium"], e["block_hashes"], e.get("parent_block_hash")) for e in mock.receive()[2]
              if e["type"] == "BlockStored"]
    assert stored == [("CPU", [b2], None), ("GPU", [low64(a1)], low64(a0)), ("CPU", [b1], None)]


def test_reset_yields_all_blocks_cleared(mock: Mock) -> None:
    seq0 = mock.sync()
    mock.complete(prompt(20))
    mock.receive()
    assert mock.http.post("/reset_prefix_cache").status_code == 200
    assert mock.receive()[1:] == (seq0 + 1, [{"type": "AllBlocksCleared"}])


def test_dropped_batches_leave_a_gap_that_replay_fills(mock: Mock) -> None:
    seq0 = mock.sync()
    state = mock.http.post(FAULTS, json={"drop_next_batches": 2}).json()
    assert (state["drop_next_batches"], state["next_seq"]) == (2, seq0)
    tokens = prompt(40)
    mock.complete(tokens)  # seq0: dropped
    mock.http.post("/reset_prefix_cache")  # seq0 + 1: dropped
    mock.http.post("/reset_prefix_cache")  # seq0 + 2: sent
    assert mock.receive()[1] == seq0 + 2
    replayed = mock.replay(seq0)
    assert [(topic, seq) for topic, seq, _ in replayed] == [(TOPIC.encode(), s) for s in (seq0, seq0 + 1, seq0 + 2)]
    assert msgpack.unpackb(replayed[0][2], raw=False)[1][0]["block_hashes"] == [low64(d) for d in digests(tokens)]
    assert mock.http.get(FAULTS).json()["fault_dropped_batches_total"] >= 2


def test_reorder_swaps_the_next_two_batches(mock: Mock) -> None:
    seq0 = mock.sync()
    assert mock.http.post(FAULTS, json={"reorder_next_two": True}).json()["reorder_armed"]
    mock.http.post("/reset_prefix_cache")
    mock.http.post("/reset_prefix_cache")
    assert [mock.receive()[1], mock.receive()[1]] == [seq0 + 1, seq0]


def test_stopped_publisher_is_silent_and_comes_back_with_a_gap(mock: Mock) -> None:
    seq0 = mock.sync()
    assert mock.http.post(FAULTS, json={"publisher": "stop"}).json()["running"] is False
    mock.complete(prompt(40))  # seq0: buffered, not sent
    assert not mock.sub.poll(PROBE_WAIT_MS)
    assert mock.http.post(FAULTS, json={"publisher": "start"}).json()["running"] is True
    after = mock.sync()  # the subscriber reconnects by itself; the first batch it sees is past the gap
    assert after > seq0 + 1
    assert [seq for _, seq, _ in mock.replay(seq0)][:2] == [seq0, seq0 + 1]
    assert mock.http.delete(FAULTS).json()["running"] is True


def test_positional_encoding_sends_vllms_older_arrays() -> None:
    for mock in serve("positional"):
        mock.sync()
        tokens = prompt(20)
        mock.complete(tokens)
        (d0,) = digests(tokens)
        assert mock.receive()[2] == [["BlockStored", [low64(d0)], None, tokens[:16], 16, None, "GPU", None, [None], 0,
                                      "full_attention"]]
        assert mock.http.post("/reset_prefix_cache").status_code == 200
        assert mock.receive()[2] == [["AllBlocksCleared"]]


def test_fault_routes_are_404_without_events() -> None:
    app = create_app(MockEngine(SPEC), served_model_name=MODEL, time_scale=TIME_SCALE, registry=CollectorRegistry())
    with serve_in_thread(app) as url:
        r = httpx.get(url + FAULTS)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_resident_blocks_name_the_engines_cache_as_its_events_do(mock: Mock) -> None:
    mock.sync()
    a, b = prompt(40), prompt(48)
    a0, a1 = digests(a)
    b0, b1, b2 = digests(b)
    mock.complete(a)
    mock.complete(b)  # 4 HBM blocks: a1 goes to the host tier (as above)
    mock.receive(), mock.receive()
    blocks = mock.http.get("/kappa/kv_events/blocks").json()
    assert blocks["GPU"] == sorted(low64(d) for d in (a0, b0, b1, b2))
    assert (blocks["CPU"], blocks["unnamed"]) == ([low64(a1)], 0)
    assert blocks["next_seq"] == mock.http.get(FAULTS).json()["next_seq"]
