"""The engine's side of P/D (`mock_vllm.pd`): a prefill keeps its blocks for a remote decode until
released; a decode admitted with pulled KV computes only the last token and caches what it got."""

from __future__ import annotations

import random

import pytest

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.pd import PdSettings, remote_prefill_params
from mock_vllm.types import EngineConfig, RequestOutput
from router.cost import BackendSpec

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BLOCK = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def run(engine: MockEngine, request_id: str, prompt: list[int], max_tokens: int = 1, **kw: object) -> RequestOutput:
    engine.add_request(request_id, prompt, max_tokens=max_tokens, arrival_s=0.0, **kw)
    now, last = 0.0, None
    while engine.has_unfinished():
        result = engine.step(now)
        now = result.end_s
        last = next((o for o in result.outputs if o.request_id == request_id), last)
    assert last is not None and last.finished
    return last


def test_a_held_prefill_keeps_its_blocks_until_released() -> None:
    engine = MockEngine(SPEC, EngineConfig(num_gpu_blocks_override=100))
    out = run(engine, "p", tokens(20 * BLOCK + 5, 1), hold_kv=True)
    assert out.kv_held_blocks == 21 and engine.held_request_ids == ["p"]
    assert engine.cache.num_free_blocks == 100 - 21 and not engine.reset_prefix_cache()  # vLLM refuses too
    assert engine.release_held("p") and not engine.release_held("p")
    assert engine.cache.num_free_blocks == 100 and engine.reset_prefix_cache()


def test_a_remote_prefilled_decode_computes_one_token_and_caches_the_pulled_blocks() -> None:
    engine = MockEngine(SPEC, EngineConfig(num_gpu_blocks_override=100))
    prompt = tokens(20 * BLOCK + 5, 2)
    run(engine, "warm", prompt[: 8 * BLOCK + 2])
    local = engine.local_prefix_blocks(prompt, None)
    assert local == 8
    before = dict(engine.stats.prompt_tokens_by_source)
    out = run(engine, "d", prompt, max_tokens=3, remote_from_block=local)
    assert out.cached_tokens == len(prompt) - 1  # vLLM's num_cached_tokens: all but the recomputed token
    delta = {k: v - before[k] for k, v in engine.stats.prompt_tokens_by_source.items()}
    assert delta == {"local_compute": 1, "local_cache_hit": 8 * BLOCK, "external_kv_transfer": len(prompt) - 8 * BLOCK}
    assert engine.local_prefix_blocks(prompt, None) == (len(prompt) - 1) // BLOCK  # pulled blocks are cached


def test_a_decode_whose_local_prefix_shrank_prefills_the_gap() -> None:
    engine = MockEngine(SPEC, EngineConfig(num_gpu_blocks_override=100))
    prompt = tokens(10 * BLOCK, 3)
    out = run(engine, "d", prompt, remote_from_block=4)  # it counted 4 local blocks; it holds none now
    assert out.cached_tokens == 0


@pytest.mark.parametrize(("params", "usable"), [
    (None, False),
    ({"do_remote_decode": True}, False),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p", "remote_request_id": "r",
      "remote_host": "h", "remote_port": 1}, True),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p", "remote_host": "h",
      "remote_port": 1}, False),  # no remote_request_id (NIXL connector version 1): served without a transfer
    ({"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "p", "remote_request_id": "r",
      "remote_host": "h", "remote_port": 1}, False),
], ids=["none", "prefill-side", "complete", "v1-params", "no-blocks"])
def test_remote_prefill_params_need_every_field(params: dict | None, usable: bool) -> None:
    assert (remote_prefill_params(params) is not None) == usable


def test_pd_settings_refuse_unknown_values() -> None:
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        PdSettings(engine_id="x", kv_load_failure_policy="retry")
    with pytest.raises(ValueError, match="kv_role"):
        PdSettings(engine_id="x", kv_role="producer")
