"""The mock engine's physics and bookkeeping, driven in virtual time (no clock, no asyncio)."""

from __future__ import annotations

import itertools
import random

import pytest

from fleet_config.catalog import default_catalog
from mock_vllm.engine import DuplicateRequest, MockEngine, PromptTooLong
from mock_vllm.types import EngineConfig, RequestOutput
from router import kappa
from router.cost import BackendSpec, RequestShape, predict

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
_ids = itertools.count()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 100_000) for _ in range(n)]


def run_one(engine: MockEngine, prompt: list[int], max_tokens: int = 1, now_s: float = 0.0,
            salt: str | None = None) -> tuple[float, float, list[RequestOutput]]:
    """Run one request to completion alone; returns (ttft_s, end_s, its outputs)."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, prompt, max_tokens=max_tokens, arrival_s=now_s, cache_salt=salt)
    outputs, ttft, now = [], None, now_s
    while engine.has_unfinished():
        step = engine.step(now)
        now = step.end_s
        for out in step.outputs:
            outputs.append(out)
            if ttft is None:
                ttft = step.end_s - now_s
    return ttft, now, outputs


def test_second_identical_prompt_hits_all_full_blocks_but_one_token() -> None:
    engine = MockEngine(H100_8B)
    prompt = tokens(2_000, seed=1)
    ttft_cold, end, first = run_one(engine, prompt)
    ttft_warm, _, second = run_one(engine, prompt, now_s=end)
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == (2_000 - 1) // 16 * 16 == 1_984
    assert ttft_warm < ttft_cold / 10
    assert engine.stats.prefix_cache_hits_tokens == 1_984
    assert engine.stats.prefix_cache_queries_tokens == 4_000


def test_hit_is_capped_at_prompt_minus_one_on_block_aligned_prompts() -> None:
    engine = MockEngine(H100_8B)
    prompt = tokens(32, seed=2)
    _, end, _ = run_one(engine, prompt)
    _, _, outs = run_one(engine, prompt, now_s=end)
    assert outs[-1].cached_tokens == 16


def test_cache_salt_separates_caches() -> None:
    engine = MockEngine(H100_8B)
    prompt = tokens(512, seed=3)
    _, end, _ = run_one(engine, prompt, salt="tenant-a")
    _, end, other = run_one(engine, prompt, now_s=end, salt="tenant-b")
    _, _, same = run_one(engine, prompt, now_s=end, salt="tenant-a")
    assert other[-1].cached_tokens == 0 and same[-1].cached_tokens == 496


def test_generates_exactly_max_tokens_and_frees_kv() -> None:
    engine = MockEngine(H100_8B)
    _, _, outs = run_one(engine, tokens(100, seed=4), max_tokens=7)
    assert [o.completion_tokens for o in outs] == [1, 2, 3, 4, 5, 6, 7]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.stats.generation_tokens_total == 7
    assert engine.stats.kv_cache_usage_ratio == 0.0  # cached blocks are free to evict


def test_lone_prefill_time_matches_the_cost_model() -> None:
    engine = MockEngine(H100_8B)
    ttft, _, _ = run_one(engine, tokens(4_000, seed=5))
    predicted = predict(RequestShape(0, 0, 4_000, 1), H100_8B)
    assert ttft == pytest.approx(predicted.prefill_s, rel=0.01)


def small_hbm_engine(host_tier_bytes: float = 64e9, **kw: object) -> MockEngine:
    # 0.3 × 80 GiB − 16 GB of weights ≈ 9.7 GB of KV ≈ 4,600 blocks ≈ 74k tokens.
    return MockEngine(H100_8B, EngineConfig(gpu_memory_utilization=0.3, host_tier_bytes=host_tier_bytes,
                                            max_num_batched_tokens=1 << 17, **kw))


def push_to_host_tier(engine: MockEngine, prefix: list[int], now_s: float) -> float:
    """Cache ``prefix``, then fill HBM with other prompts so its blocks are evicted to the host tier."""
    _, now, _ = run_one(engine, prefix, now_s=now_s)
    filler_tokens = engine.cache.num_gpu_blocks * engine.block_size
    for seed in range(1000, 1000 + filler_tokens // 30_000 + 2):
        _, now, _ = run_one(engine, tokens(30_000, seed), now_s=now)
    assert engine.cache.match(engine_hashes(engine, prefix), 10**9) == (0, len(prefix) // 16, 0)
    return now


def engine_hashes(engine: MockEngine, prompt: list[int]) -> list[int]:
    from mock_vllm.kv_cache import prompt_block_hashes

    return prompt_block_hashes(prompt, engine.block_size, None)


def ttft_with_host_prefix(cached_tokens: int, uncached_prompt_tokens: int) -> float:
    engine = small_hbm_engine()
    prefix = tokens(cached_tokens, seed=cached_tokens)
    now = push_to_host_tier(engine, prefix, 0.0)
    ttft, _, outs = run_one(engine, prefix + tokens(uncached_prompt_tokens, seed=7 + uncached_prompt_tokens), now_s=now)
    assert outs[0].cached_host_tokens == cached_tokens
    return ttft


def test_host_tier_hit_is_loaded_over_the_sustained_link() -> None:
    engine = small_hbm_engine()
    prefix = tokens(8_000, seed=11)
    now = push_to_host_tier(engine, prefix, 0.0)
    loaded_before = engine.stats.host_kv_loaded_bytes_total
    run_one(engine, prefix + tokens(100, seed=12), now_s=now)
    assert engine.stats.host_kv_loaded_bytes_total - loaded_before == 8_000 * kappa.b_kv_bytes(H100_8B.model)
    assert engine.stats.prompt_tokens_by_source["external_kv_transfer"] == 8_000
    assert engine.stats.external_prefix_cache_hits_tokens == 8_000


def test_without_host_tier_evicted_prefixes_are_recomputed() -> None:
    engine = small_hbm_engine(host_tier_bytes=0)
    prefix = tokens(8_000, seed=13)
    _, now, _ = run_one(engine, prefix)
    for seed in range(2000, 2004):
        _, now, _ = run_one(engine, tokens(30_000, seed), now_s=now)
    _, _, outs = run_one(engine, prefix + tokens(100, seed=14), now_s=now)
    assert outs[0].cached_tokens == 0


def test_kappa_crossover_lies_within_10_percent_of_kappa_crit() -> None:
    """Sweep K (host tier) at fixed T: TTFT grows with T below the crossover, with K above it.

    The crossover is found from TTFT alone: the intersection of the lines fitted to the
    low-K and high-K ends of the sweep.
    """
    new = 2_000
    crit = kappa.kappa_crit(H100_8B.model, H100_8B.kappa_hw, uncached_prompt_tokens=new)
    kappas = [crit * f for f in (0.25, 0.4, 0.55, 1.6, 1.8, 2.0)]
    ttft = {x: ttft_with_host_prefix(round(x * new / 16) * 16, new) for x in kappas}
    (x0, x1), (x2, x3) = kappas[:2], kappas[-2:]
    slope_lo = (ttft[x1] - ttft[x0]) / (x1 - x0)
    slope_hi = (ttft[x3] - ttft[x2]) / (x3 - x2)
    assert slope_hi > 2 * slope_lo  # above the crossover TTFT grows faster with K (loads, not attention)
    crossover = (ttft[x2] - slope_hi * x2 - ttft[x0] + slope_lo * x0) / (slope_lo - slope_hi)
    assert crossover == pytest.approx(crit, rel=0.10)
    # Below the crossover TTFT grows with T; above it, T hardly matters.
    low_k, high_k = round(0.25 * crit * new / 16) * 16, round(2.0 * crit * new / 16) * 16
    assert ttft_with_host_prefix(low_k, 2 * new) > 1.5 * ttft_with_host_prefix(low_k, new)
    assert ttft_with_host_prefix(high_k, new + 200) == pytest.approx(ttft_with_host_prefix(high_k, new), rel=0.02)


def test_continuous_batching_respects_max_num_seqs_and_token_budget() -> None:
    engine = MockEngine(H100_8B, EngineConfig(max_num_seqs=4, max_num_batched_tokens=1_024))
    for i in range(10):
        engine.add_request(f"q{i}", tokens(3_000, seed=100 + i), max_tokens=5, arrival_s=0.0)
    now, finished, steps = 0.0, 0, 0
    while engine.has_unfinished():
        step = engine.step(now)
        now, steps = step.end_s, steps + 1
        assert engine.stats.num_requests_running <= 4
        assert step.num_prefill_tokens + step.num_decode_tokens <= 1_024
        finished += sum(o.finished for o in step.outputs)
    assert finished == 10 and steps >= 10 * 3_000 // 1_024


def test_preemption_when_kv_runs_out_keeps_every_stream_whole() -> None:
    # Tiny KV: 0.2 × 80 GiB − 16 GB ≈ 1.1 GB ≈ 530 blocks ≈ 8.5k tokens, for 6 × (1,000 + 600).
    engine = MockEngine(H100_8B, EngineConfig(gpu_memory_utilization=0.2))
    for i in range(6):
        engine.add_request(f"p{i}", tokens(1_000, seed=200 + i), max_tokens=600, arrival_s=0.0)
    counts: dict[str, list[int]] = {f"p{i}": [] for i in range(6)}
    now = 0.0
    while engine.has_unfinished():
        step = engine.step(now)
        now = step.end_s
        for out in step.outputs:
            counts[out.request_id].append(out.completion_tokens)
    assert engine.stats.num_preemptions_total > 0
    assert all(seq == list(range(1, 601)) for seq in counts.values())


def test_abort_frees_blocks_and_counts() -> None:
    engine = MockEngine(H100_8B)
    engine.add_request("a", tokens(5_000, seed=300), max_tokens=100, arrival_s=0.0)
    engine.step(0.0)
    assert engine.stats.kv_cache_usage_ratio > 0
    assert engine.abort("a") and not engine.abort("a")
    assert not engine.has_unfinished() and engine.stats.kv_cache_usage_ratio == 0
    assert engine.stats.request_success_total["abort"] == 1


def test_reset_prefix_cache_forgets_hits_and_is_refused_while_running() -> None:
    engine = MockEngine(H100_8B)
    prompt = tokens(1_000, seed=400)
    _, end, _ = run_one(engine, prompt)
    engine.add_request("busy", tokens(100, seed=401), max_tokens=50, arrival_s=end)
    engine.step(end)
    assert engine.reset_prefix_cache() is False
    engine.abort("busy")
    assert engine.reset_prefix_cache() is True
    _, _, outs = run_one(engine, prompt, now_s=end)
    assert outs[-1].cached_tokens == 0


def test_prompt_too_long_has_vllms_message_and_duplicates_are_refused() -> None:
    engine = MockEngine(H100_8B)
    with pytest.raises(PromptTooLong, match=r"maximum context length is 131072 tokens\. However, you requested 131073"):
        engine.add_request("x", [1] * 131_000, max_tokens=73, arrival_s=0.0)
    engine.add_request("y", [1, 2, 3], max_tokens=1, arrival_s=0.0)
    with pytest.raises(DuplicateRequest):
        engine.add_request("y", [1, 2, 3], max_tokens=1, arrival_s=0.0)


def test_energy_idle_and_transfer_bound_power() -> None:
    engine = small_hbm_engine()
    assert engine.energy_j(10.0) == 0.0  # nothing has arrived yet
    prefix = tokens(40_000, seed=500)
    now = push_to_host_tier(engine, prefix, 0.0)
    engine.add_request("t", prefix + tokens(200, seed=501), max_tokens=1, arrival_s=now)
    step = engine.step(now)
    assert step.load_s > step.compute_s  # κ_ratio 200 ≫ κ_crit
    assert engine.power_w(step.start_s) < 0.5 * H100_8B.max_power_w
    assert engine.power_w(step.end_s + 1.0) == H100_8B.idle_power_w
    idle_only = H100_8B.idle_power_w * (step.end_s + 1.0)
    assert engine.energy_j(step.end_s + 1.0) > idle_only


def test_preempted_prefill_reports_the_first_admissions_hit_not_its_own_blocks() -> None:
    """Regression: a request preempted mid-prefill and re-admitted reported its own recomputed
    blocks as cached tokens (6× the shareable prefix under KV pressure)."""
    # ~534 blocks (8.5k tokens) of KV; chunks of 2,048 admit a third prompt whose next chunk no
    # longer fits, so it is preempted mid-prefill and re-admitted onto its own cached blocks.
    engine = MockEngine(H100_8B, EngineConfig(gpu_memory_utilization=0.2, max_num_batched_tokens=2_048))
    for i in range(8):
        engine.add_request(f"c{i}", tokens(2_500, seed=600 + i), max_tokens=50, arrival_s=0.0)
    cached: dict[str, int] = {}
    now = 0.0
    while engine.has_unfinished():
        step = engine.step(now)
        now = step.end_s
        for out in step.outputs:
            cached[out.request_id] = out.cached_tokens
    assert engine.stats.num_preemptions_total > 0
    assert cached == {f"c{i}": 0 for i in range(8)}  # distinct prompts share nothing
