"""Builds a mock vLLM server app from catalog profiles and vLLM-style settings.

The glue between ``kappa-gateway mock-vllm`` (which reads the catalog) and
`mock_vllm.server.create_app` (which takes a ready engine): profiles in, app out, no files
or environment read here.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from mock_vllm.engine import MockEngine
from mock_vllm.kv_cache import SharedKVPool
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from router.cost import BackendSpec
from router.profiles import GB, HardwareProfile, ModelProfile


def build_app(
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    host_tier_gb: float = 0.0,
    power_cap_w: float | None = None,
    tensor_parallel: int = 1,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    num_gpu_blocks_override: int | None = None,
    time_scale: float = 1.0,
    served_model_name: str | None = None,
    registry: CollectorRegistry | None = None,
    pool: SharedKVPool | None = None,
    pool_link_gb_s: float | None = None,
) -> FastAPI:
    """A mock vLLM app for ``model`` on ``hardware``.

    Args:
        model, hardware: catalog profiles.
        host_tier_gb: CPU offload tier for evicted KV blocks, GB (10^9 bytes); 0 = none.
        power_cap_w: board power cap, W (``None``: TDP).
        tensor_parallel: GPUs in the TP group, ≥ 1.
        max_num_seqs, max_num_batched_tokens: vLLM's flags; ``None`` keeps `EngineConfig`'s
            defaults (256 and 8192).
        num_gpu_blocks_override: KV blocks instead of what HBM allows (vLLM
            ``--num-gpu-blocks-override``); ``None`` sizes the cache from HBM.
        time_scale: wall seconds per engine second, > 0 (0.01 = 100× faster than real time).
        served_model_name: the name clients use; defaults to the catalog model name.
        registry: metrics registry; a fresh one when ``None``.
        pool: a fleet-shared KV pool (`mock_vllm.kv_cache.SharedKVPool`) this mock writes its
            prefilled blocks to and loads prefix misses from; share one object between the
            apps of one process to model a fleet's pool. ``None``: no pool.
        pool_link_gb_s: sustained pool → HBM bandwidth of the whole TP group, GB/s, > 0;
            required with ``pool``, ignored by the engine without one.

    Raises:
        ValueError: an invalid setting (negative host tier, TP < 1, time_scale ≤ 0, a pool
            without ``pool_link_gb_s``, pool_link_gb_s ≤ 0, or a model whose weights leave
            no KV memory on this hardware).
    """
    backend = BackendSpec(model=model, hardware=hardware, power_cap_w=power_cap_w, tensor_parallel=tensor_parallel,
                          pool_link_gb_s=pool_link_gb_s)
    limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "num_gpu_blocks_override": num_gpu_blocks_override}
    config = EngineConfig(host_tier_bytes=host_tier_gb * GB, **{k: v for k, v in limits.items() if v is not None})
    return create_app(MockEngine(backend, config, pool), served_model_name=served_model_name or model.name,
                      time_scale=time_scale, registry=registry)
