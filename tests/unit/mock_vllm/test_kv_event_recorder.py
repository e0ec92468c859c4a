"""vLLM's block hashes and the KV events the engine records from its real cache state (pure: no I/O).

Expected hashes are computed here with hashlib and pickle from vLLM's rule
(``vllm/v1/core/kv_cache_utils.py``: sha256 of the pickled ``(parent, tokens, extra_keys)``, parent
``NONE_HASH`` = sha256 of the pickled seed for the first block, low 64 bits published), and one is
pinned as a literal so that a change of rule or of pickle shows.
"""

from __future__ import annotations

import hashlib
import pickle
import random

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.kv_cache import SharedKVPool, prompt_block_hashes
from mock_vllm.kv_event_recorder import KVEventRecorder
from mock_vllm.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored
from mock_vllm.types import EngineConfig
from mock_vllm.vllm_block_hash import BlockChain, external_block_hash, none_hash
from router.capacity import kv_block_bytes
from router.cost import BackendSpec

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BLOCK = 16


def sha(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = sha("vllm-none-hash")


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def chain_digests(tokens: list[int], salt: str | None = None, none: bytes = NONE_HASH) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        extra = (salt,) if i == 0 and salt else None
        out.append(sha((out[-1] if out else none, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]), extra)))
    return out


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 128_000) for _ in range(n)]


def test_none_hash_and_a_first_block_match_pinned_values() -> None:
    assert none_hash(None).hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    chain = BlockChain(list(range(40)), None, BLOCK, none_hash(None))
    assert external_block_hash(chain.digest(0)) == 3262291359910021016
    assert external_block_hash(chain.digest(1)) == low64(sha((chain.digest(0), tuple(range(16, 32)), None)))


def test_python_hash_seed_replaces_the_default_seed() -> None:
    assert none_hash("0") == sha("0") != none_hash(None)
    prompt = tokens(32, seed=3)
    seeded = BlockChain(prompt, None, BLOCK, none_hash("0"))
    assert seeded.digest(1) == chain_digests(prompt, none=sha("0"))[1]


def test_cache_salt_is_an_extra_key_of_the_first_block_only() -> None:
    prompt = tokens(48, seed=4)
    salted = BlockChain(prompt, "tenant-a", BLOCK, NONE_HASH)
    assert [salted.digest(i) for i in range(3)] == chain_digests(prompt, "tenant-a")
    assert salted.digest(0) == sha((NONE_HASH, tuple(prompt[:16]), ("tenant-a",)))
    assert salted.digest(0) != chain_digests(prompt)[0]


def small_engine() -> tuple[MockEngine, KVEventRecorder]:
    """4 HBM blocks and 2 host-tier blocks: every eviction below is forced and predictable."""
    host = 2 * kv_block_bytes(H100_8B, BLOCK)
    engine = MockEngine(H100_8B, EngineConfig(num_gpu_blocks_override=4, host_tier_bytes=host))
    recorder = KVEventRecorder(BLOCK)
    engine.enable_kv_events(recorder)
    return engine, recorder


def run(engine: MockEngine, rid: str, prompt: list[int], now_s: float, salt: str | None = None) -> float:
    engine.add_request(rid, prompt, max_tokens=1, arrival_s=now_s, cache_salt=salt)
    while engine.has_unfinished():
        now_s = engine.step(now_s).end_s
    return now_s


def gpu_stored(digests: list[bytes], parent: bytes | None, toks: list[int], extra: list) -> BlockStored:
    return BlockStored(block_hashes=[low64(d) for d in digests], parent_block_hash=None if parent is None else low64(parent),
                       token_ids=toks, block_size=BLOCK, medium="GPU", extra_keys=extra, group_idx=0,
                       kv_cache_spec_kind="full_attention")


def cpu_stored(digest: bytes) -> BlockStored:
    return BlockStored(block_hashes=[digest], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")


def test_events_follow_prefill_eviction_offload_reload_and_reset() -> None:
    engine, recorder = small_engine()
    a, b = tokens(40, seed=5), tokens(48, seed=6)
    a0, a1 = chain_digests(a)
    b0, b1, b2 = chain_digests(b)

    now = run(engine, "a", a, 0.0)  # 3 blocks; blocks 0, 1 full and cached; freed deepest first
    assert recorder.take() == [gpu_stored([a0, a1], None, a[:32], [None, None])]

    now = run(engine, "b", b, now)  # 3 new blocks, 2 never used: a1 (LRU) is evicted to the host tier
    assert recorder.take() == [cpu_stored(a1), BlockRemoved([low64(a1)], "GPU", 0),
                               gpu_stored([b0, b1, b2], None, b, [None, None, None])]

    run(engine, "a-again", a, now)  # a0 hit in HBM, a1 loaded back from the host tier (evicting b2),
    # then one block for the tail evicts b1, whose offload pushes a1 out of the 2-block host tier
    assert recorder.take() == [cpu_stored(b2), BlockRemoved([low64(b2)], "GPU", 0),
                               gpu_stored([a1], a0, a[16:32], [None]),
                               cpu_stored(b1), BlockRemoved([low64(b1)], "GPU", 0),
                               BlockRemoved([a1], "CPU")]

    assert engine.reset_prefix_cache()
    assert recorder.take() == [AllBlocksCleared()]
    assert recorder.take() == []


def test_salted_request_reports_its_salt_on_block_zero() -> None:
    engine, recorder = small_engine()
    prompt = tokens(33, seed=7)
    run(engine, "s", prompt, 0.0, salt="tenant-a")
    d0, d1 = chain_digests(prompt, "tenant-a")
    assert recorder.take() == [gpu_stored([d0, d1], None, prompt[:32], [("tenant-a",), None])]


def test_chunked_prefill_announces_each_chunk_with_its_parent() -> None:
    engine = MockEngine(H100_8B, EngineConfig(max_num_batched_tokens=32))
    recorder = KVEventRecorder(BLOCK)
    engine.enable_kv_events(recorder)
    prompt = tokens(80, seed=8)
    run(engine, "c", prompt, 0.0)
    d = chain_digests(prompt)
    assert recorder.take() == [gpu_stored(d[0:2], None, prompt[0:32], [None, None]),
                               gpu_stored(d[2:4], d[1], prompt[32:64], [None, None]),
                               gpu_stored(d[4:5], d[3], prompt[64:80], [None])]


def test_an_engine_without_events_records_nothing() -> None:
    engine = MockEngine(H100_8B)
    engine.add_request("x", tokens(40, seed=9), max_tokens=1, arrival_s=0.0)
    assert engine._requests["x"].event_chain is None and engine.cache.listener is None


def test_blocks_loaded_from_the_shared_pool_are_announced_as_gpu_blocks() -> None:
    spec = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"), kv_pool_link_gb_s=25.0)
    pool = SharedKVPool(1_000)
    writer, reader = MockEngine(spec, kv_pool=pool), MockEngine(spec, kv_pool=pool)
    recorder = KVEventRecorder(BLOCK)
    reader.enable_kv_events(recorder)
    prompt = tokens(50, seed=10)
    run(writer, "w", prompt, 0.0)  # the writer's prefill is written through to the pool
    run(reader, "r", prompt, 0.0)  # the reader loads blocks 0..2 from the pool (hit capped at 49 tokens)
    d = chain_digests(prompt)
    assert recorder.take() == [gpu_stored(d[0:3], None, prompt[0:48], [None, None, None])]


def test_non_contiguous_loads_are_one_event_per_run() -> None:
    recorder = KVEventRecorder(BLOCK)
    prompt = tokens(80, seed=11)
    chain = recorder.chain(prompt, None)
    recorder.gpu_cached(chain, list(range(100, 105)), [1, 2, 4])
    d = chain_digests(prompt)
    assert recorder.take() == [gpu_stored(d[1:3], d[0], prompt[16:48], [None, None]),
                               gpu_stored(d[4:5], d[3], prompt[64:80], [None])]


def test_the_same_blocks_computed_twice_at_once_are_announced_once() -> None:
    """Two requests admitted in one step both compute blocks 0-1; the cache keeps one copy (the second seal
    de-duplicates), so one BlockStored, and the one eviction later is the one BlockRemoved."""
    engine = MockEngine(H100_8B, EngineConfig(num_gpu_blocks_override=8))  # room for both at once
    recorder = KVEventRecorder(BLOCK)
    engine.enable_kv_events(recorder)
    prompt = tokens(40, seed=12)
    engine.add_request("a", prompt, max_tokens=1, arrival_s=0.0)
    engine.add_request("b", prompt, max_tokens=1, arrival_s=0.0)
    now_s = 0.0
    while engine.has_unfinished():
        now_s = engine.step(now_s).end_s
    d0, d1 = chain_digests(prompt)
    assert recorder.take() == [gpu_stored([d0, d1], None, prompt[:32], [None, None])]
    assert engine.cache.resident_hashes() == (prompt_block_hashes(prompt, BLOCK, None), [])  # one copy of each
