"""The mock engine's P/D halves as the simulator drives them (vLLM NixlConnector's ``do_remote_decode``:
``hold_kv``; ``do_remote_prefill``: ``remote_from_block``)."""

from __future__ import annotations

import random

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from router.cost import BackendSpec

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 100_000) for _ in range(n)]


def drain(engine: MockEngine, now: float = 0.0) -> tuple[float, list]:
    outs = []
    while engine.has_unfinished():
        step = engine.step(now)
        now = step.end_s
        outs += step.outputs
    return now, outs


def test_a_remote_decode_prefill_keeps_its_blocks_until_released() -> None:
    engine = MockEngine(H100_8B)
    engine.add_request("p", tokens(1_000, 1), max_tokens=1, arrival_s=0.0, hold_kv=True)
    _, outs = drain(engine)
    assert outs[-1].finished and outs[-1].completion_tokens == 1
    held = engine.cache.num_gpu_blocks - engine.cache.num_free_blocks
    assert held == -(-1_000 // 16)  # every block of the prompt, still referenced
    assert not engine.reset_prefix_cache()  # blocks in use: refused, as vLLM does
    assert engine.release_held("p") and not engine.release_held("p")
    assert engine.cache.num_free_blocks == engine.cache.num_gpu_blocks  # freed, cached (evictable)


def test_a_remote_prefill_decode_computes_only_the_last_token() -> None:
    prompt = tokens(4_000, 2)
    cold = MockEngine(H100_8B)
    cold.add_request("a", prompt, max_tokens=4, arrival_s=0.0)
    cold_end, _ = drain(cold)
    engine = MockEngine(H100_8B)
    engine.add_request("d", prompt, max_tokens=4, arrival_s=0.0, remote_from_block=0)
    first = engine.step(0.0)
    assert first.num_prefill_tokens == 1 and first.outputs[0].completion_tokens == 1
    assert first.outputs[0].cached_tokens == 3_999  # vLLM counts the pulled tokens as computed
    end, _ = drain(engine, first.end_s)
    assert end < cold_end / 5  # no prefill of the prompt
    by_source = engine.stats.prompt_tokens_by_source
    # vLLM's PromptTokenStats: computed + local_cache_hit + external_kv_transfer − recomputed = total
    assert by_source == {"local_compute": 1, "local_cache_hit": 0, "external_kv_transfer": 4_000}
    # the pulled blocks are cached here now: the next request with this prompt hits them
    engine.add_request("again", prompt, max_tokens=1, arrival_s=end)
    _, outs = drain(engine, end)
    assert outs[-1].cached_tokens == 3_999 // 16 * 16


def test_a_remote_prefill_references_its_own_prefix_and_counts_only_the_rest_as_pulled() -> None:
    prompt = tokens(2_048, 3)
    engine = MockEngine(H100_8B)
    engine.add_request("warm", prompt[:1_024], max_tokens=1, arrival_s=0.0)
    end, _ = drain(engine)
    engine.add_request("d", prompt, max_tokens=2, arrival_s=end,
                       remote_from_block=engine.local_prefix_blocks(prompt, None))
    drain(engine, end)
    by_source = engine.stats.prompt_tokens_by_source
    assert by_source["local_cache_hit"] == 1_024
    assert by_source["external_kv_transfer"] == 2_048 - 1_024
