"""A backend's KV-cache capacity: vLLM's sizing rule and its defaults, defined once.

vLLM sizes its KV cache at start-up (``vllm/v1/worker/gpu_worker.py``
``determine_available_memory``, ``vllm/v1/core/kv_cache_utils.py``): the share
``gpu_memory_utilization`` of HBM, less the weights, split into blocks of ``block_size``
tokens; ``--num-gpu-blocks-override`` replaces the count. One block holds
``block_size · B_kv`` bytes (B_kv from `router.kappa`). The mock engine sizes its cache with
this rule, the gateway assumes it until a scrape of ``vllm:cache_config_info`` reports the
real count, and the simulator's router reads what that scrape would say.

(vLLM also reserves activation memory found by a profiling run; the rule leaves it out, so it
errs high by a few GB on a real server — one more reason the scraped figure wins.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router import kappa

if TYPE_CHECKING:
    from router.cost import BackendSpec

# vLLM's --gpu-memory-utilization default: the share of HBM vLLM may fill (weights + KV).
VLLM_GPU_MEMORY_UTILIZATION = 0.9
# vLLM's --block-size default on CUDA: tokens per KV block (MLA backends use 64; scraped when known).
VLLM_BLOCK_SIZE_TOKENS = 16


def kv_cache_blocks(backend: BackendSpec, *, block_size_tokens: int = VLLM_BLOCK_SIZE_TOKENS,
                    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION,
                    num_gpu_blocks_override: int | None = None) -> int:
    """KV blocks a vLLM engine of ``backend`` allocates.

    = ``num_gpu_blocks_override`` if given, else
    ⌊(HBM · TP · gpu_memory_utilization − weight bytes) / (block_size_tokens · B_kv)⌋.

    Returns:
        The block count; ≤ 0 when the weights leave no room (the caller decides what that means).
    """
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override
    budget = backend.hardware.hbm_bytes * backend.tensor_parallel * gpu_memory_utilization
    return int((budget - backend.model.weight_bytes) // kv_block_bytes(backend, block_size_tokens))


def kv_block_bytes(backend: BackendSpec, block_size_tokens: int) -> float:
    """Bytes of one KV block: block_size_tokens · B_kv (nominal, `router.kappa.b_kv_bytes`)."""
    return block_size_tokens * kappa.b_kv_bytes(backend.model)


def kv_capacity_bytes(backend: BackendSpec, *, num_gpu_blocks: int | None = None, block_size_tokens: int | None = None,
                      num_gpu_blocks_override: int | None = None) -> float:
    """KV memory of a backend, bytes: what a scrape reported if it did, else vLLM's sizing rule.

    Args:
        backend: its static figures.
        num_gpu_blocks, block_size_tokens: ``vllm:cache_config_info``'s labels, when scraped
            (both needed; ``None`` before the first scrape or if not exported).
        num_gpu_blocks_override: the config's ``--num-gpu-blocks-override`` (in
            `VLLM_BLOCK_SIZE_TOKENS`-token blocks), used until a scrape says otherwise.

    Returns:
        num_gpu_blocks · block_size · B_kv, never below 0.
    """
    if num_gpu_blocks and block_size_tokens:
        return num_gpu_blocks * kv_block_bytes(backend, block_size_tokens)
    blocks = kv_cache_blocks(backend, num_gpu_blocks_override=num_gpu_blocks_override)
    return max(blocks, 0) * kv_block_bytes(backend, VLLM_BLOCK_SIZE_TOKENS)
