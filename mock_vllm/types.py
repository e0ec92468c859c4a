"""Plain data the mock engine takes and returns: configuration, per-step outputs, statistics.

Kept apart from `mock_vllm.engine` so the HTTP server and the simulator can depend on the
shapes without the scheduler's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.capacity import VLLM_BLOCK_SIZE_TOKENS, VLLM_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM engine settings the mock honours (names as vLLM's CLI flags).

    Args:
        block_size_tokens: KV block size (vLLM ``--block-size``, default 16).
        gpu_memory_utilization: share of HBM vLLM may use (weights + KV), vLLM default 0.9.
        max_num_seqs: most sequences in one batch (vLLM default 256 on the v1 engine).
        max_num_batched_tokens: token budget per step; prompts beyond it are chunked
            (chunked prefill, vLLM v1 default 8192 for online serving).
        host_tier_bytes: CPU offload tier for evicted KV blocks (0 = none), bytes.
        max_model_len_tokens: context limit; ``None`` takes the model profile's.
        default_max_tokens: ``max_tokens`` for requests that give none. vLLM fills the
            context; the mock stops at this many so an omitted field cannot run for hours.
        num_gpu_blocks_override: use this many KV blocks instead of what HBM allows (vLLM
            ``--num-gpu-blocks-override``); ``None`` sizes the cache from HBM.
    """

    block_size_tokens: int = VLLM_BLOCK_SIZE_TOKENS
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    host_tier_bytes: float = 0.0
    max_model_len_tokens: int | None = None
    default_max_tokens: int = 256
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size_tokens < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size_tokens, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.host_tier_bytes < 0:
            raise ValueError("host_tier_bytes must be >= 0")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced in one step (visible at the step's end).

    ``cached_tokens`` is the prefix hit found when the request was scheduled (HBM plus
    host tier and shared pool, capped at prompt − 1 as vLLM does); ``cached_host_tokens``
    the part of it loaded from the host tier, ``cached_kv_pool_tokens`` the part loaded from
    the fleet-shared KV pool. ``scheduled_s``: the start of the step that first scheduled it
    (engine seconds; vLLM's ``scheduled_ts``, where its queue time ends and prefill time begins).
    ``kv_held_blocks``: on the finishing output of a ``hold_kv`` request, the KV blocks it keeps
    for a remote decode (vLLM's ``remote_block_ids``); 0 otherwise.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    cached_host_tokens: int
    completion_tokens: int
    finished: bool
    finish_reason: str | None = None  # "length" (EOS is ignored) or "abort"
    cached_kv_pool_tokens: int = 0
    scheduled_s: float | None = None
    kv_held_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """One engine step: it starts at ``start_s`` and its outputs appear at ``end_s``.

    Times in seconds of engine time; ``compute_s``, ``hbm_s``, ``load_s`` are the step's
    roofline parts (``duration_s`` = max(compute, hbm) combined with load per the backend's
    overlap setting).
    """

    start_s: float
    duration_s: float
    outputs: tuple[RequestOutput, ...]
    compute_s: float = 0.0
    hbm_s: float = 0.0
    load_s: float = 0.0
    host_load_bytes: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    utilisation: float = 0.0
    kv_pool_load_bytes: float = 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(slots=True)
class EngineStats:
    """Gauges and monotonically growing counters, with vLLM's meanings (REFERENCE.md §2).

    Token counters count prompt tokens; ``prompt_tokens_by_source`` splits them into
    ``local_compute`` (prefilled), ``local_cache_hit`` (HBM hit) and ``external_kv_transfer``
    (loaded from the host tier or the shared pool: vLLM's KV connector, either way).
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_ratio: float = 0.0
    num_gpu_blocks: int = 0
    num_host_blocks: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    external_prefix_cache_queries_tokens: int = 0
    external_prefix_cache_hits_tokens: int = 0
    prompt_tokens_by_source: dict[str, int] = field(
        default_factory=lambda: {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    )
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    host_kv_loaded_bytes_total: float = 0.0
    kv_pool_loaded_bytes_total: float = 0.0
    request_success_total: dict[str, int] = field(default_factory=lambda: {"length": 0, "abort": 0})
