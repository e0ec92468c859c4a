"""A pure, step-driven model of one vLLM engine (one GPU or TP group) on given hardware.

No asyncio and no clock inside: the caller asks for one `step` at a time, starting at a
time it passes in, and gets back how long the step takes and what it produced. The HTTP
server (`mock_vllm.server`) runs it in real time, the simulator (`sim/`) in virtual time.

What it models (DESIGN.md §5):
- Scheduling as vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``): running requests
  first (one decode token each, or the next prefill chunk), then waiting requests FIFO,
  within ``max_num_seqs`` and a ``max_num_batched_tokens`` budget (chunked prefill); when
  KV blocks run out for a running request, the most recently admitted one is preempted
  (its blocks freed, recomputed later).
- The paged prefix cache, host tier and (optional) fleet-shared KV pool of
  `mock_vllm.kv_cache`; hits count whole blocks and are capped at prompt − 1 tokens, as
  vLLM does.
- Step time from the backend's profile (`router.cost.roofline`, the formula the router's
  prediction uses too, on `router.cost.BackendSpec` figures):
  compute = FLOPs / C_eff (FLOPs from `router.kappa.prefill_flops`), HBM = (weights read +
  KV read) / HBM bandwidth, load = host-tier KV bytes / sustained link bandwidth + pool
  KV bytes / pool link bandwidth (`BackendSpec.kv_pool_link_bytes_per_s`);
  duration = max(compute, HBM, load) when loads overlap compute, else max(compute, HBM) + load.
  Weights read per step: `router.cost.weights_read_bytes` (all of a dense model; the
  experts a batch touches of an MoE).
- Power = idle + (P_max − idle) × the roofline's utilisation; energy accumulates.
- KV blocks: `router.capacity.kv_cache_blocks` (vLLM's sizing rule, or the override).
- Every request generates exactly ``max_tokens`` tokens (EOS ignored), so traces replay exactly.
- P/D (`mock_vllm.pd`, vLLM's NixlConnector): a request added with ``hold_kv`` keeps its blocks
  referenced when it finishes (the prefill side, until `release_held`); one added with
  ``remote_from_block`` was pulled from a remote engine from that block on: it is admitted with
  its whole prompt computed but the last token (recomputed, as vLLM does), the pulled full blocks
  cached here from then on. The pull itself happens outside the engine (its time is the server's).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import xxhash

from mock_vllm.engine_request import EngineRequest
from mock_vllm.kv_event_recorder import KVEventRecorder
from mock_vllm.kv_cache import OutOfBlocks, PagedKVCache, SharedKVPool, prompt_block_hashes
from mock_vllm.types import EngineConfig, EngineStats, RequestOutput, StepResult
from router import kappa
from router.capacity import kv_block_bytes, kv_cache_blocks
from router.cost import BackendSpec, roofline, weights_read_bytes

GENERATED_TOKEN_BASE = 1000  # generated ids land in [1000, 51000): deterministic pseudo-text


class EngineError(Exception):
    """Base of the mock engine's errors."""


class PromptTooLong(EngineError, ValueError):
    """prompt + max_tokens exceeds max_model_len, or the KV cache could never hold the request."""


class DuplicateRequest(EngineError, ValueError):
    """A request id that is already in the engine."""


class MockEngine:
    """One engine: add requests, call `step` while `has_unfinished`, read `stats`.

    Args:
        backend: model, hardware and deployment figures (`router.cost.BackendSpec`).
        config: vLLM engine settings (`EngineConfig`).
        kv_pool: the fleet-shared KV pool this engine writes through to and loads from
            (``None``: none); the backend's ``kv_pool_link_gb_s`` must then be set.

    Raises:
        ValueError: the weights leave no HBM for even one KV block, or a pool without a pool link.
    """

    def __init__(self, backend: BackendSpec, config: EngineConfig | None = None,
                 kv_pool: SharedKVPool | None = None) -> None:
        if kv_pool is not None and not backend.kv_pool_link_bytes_per_s:
            raise ValueError("an engine on a shared KV pool needs the backend's kv_pool_link_gb_s")
        self.backend = backend
        self.config = config = config or EngineConfig()
        model = backend.model
        self.block_size = config.block_size_tokens
        self.block_bytes = kv_block_bytes(backend, self.block_size)
        num_gpu_blocks = kv_cache_blocks(backend, block_size_tokens=self.block_size,
                                         gpu_memory_utilization=config.gpu_memory_utilization,
                                         num_gpu_blocks_override=config.num_gpu_blocks_override)
        if num_gpu_blocks < 1:
            raise ValueError(f"{model.name} weights leave no KV memory on {backend.hardware.name}")
        self.cache = PagedKVCache(num_gpu_blocks, int(config.host_tier_bytes // self.block_bytes), kv_pool,
                                  xxhash.xxh3_64_intdigest(model.name.encode()))
        self.max_model_len_tokens = min(config.max_model_len_tokens or model.max_model_len_tokens,
                                        num_gpu_blocks * self.block_size)
        self.stats = EngineStats(num_gpu_blocks=num_gpu_blocks, num_host_blocks=self.cache.num_host_blocks)
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._requests: dict[str, EngineRequest] = {}
        self._held: dict[str, EngineRequest] = {}  # finished, blocks kept for a remote decode
        self._dynamic_energy_j = 0.0
        self._last_step: StepResult | None = None
        self._start_s: float | None = None
        self.kv_events: KVEventRecorder | None = None  # vLLM's KV events, when enabled (`enable_kv_events`)

    def enable_kv_events(self, recorder: KVEventRecorder) -> None:
        """Record vLLM's KV-cache events into ``recorder`` from now on; call before the first request."""
        self.kv_events = recorder
        self.cache.listener = recorder

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], *, max_tokens: int,
                    arrival_s: float, cache_salt: str | None = None, hold_kv: bool = False,
                    remote_from_block: int | None = None) -> None:
        """Queue a request; it is scheduled by a later `step`.

        ``hold_kv``: keep its blocks after it finishes (`release_held`); ``remote_from_block``:
        the prompt's blocks from this one on were pulled from a remote engine (module docstring).

        Raises:
            PromptTooLong: prompt + max_tokens > max_model_len (vLLM's message).
            DuplicateRequest: ``request_id`` is in use.
            ValueError: empty prompt or max_tokens < 1.
        """
        if request_id in self._requests:
            raise DuplicateRequest(f"request id {request_id!r} is already running")
        if not prompt_token_ids or max_tokens < 1:
            raise ValueError("the prompt must hold at least one token and max_tokens must be >= 1")
        prompt_len = len(prompt_token_ids)
        if prompt_len + max_tokens > self.max_model_len_tokens:
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len_tokens} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        if self._start_s is None:
            self._start_s = arrival_s
        req = EngineRequest(request_id, prompt_len, max_tokens,
                       prompt_block_hashes(prompt_token_ids, self.block_size, cache_salt), arrival_s, prompt_len,
                       hold_kv=hold_kv, remote_from_block=remote_from_block)
        if self.kv_events is not None:
            req.event_chain = self.kv_events.chain(prompt_token_ids, cache_salt)
        self._requests[request_id] = req
        self._waiting.append(req)
        self._refresh_gauges()

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); frees its blocks. Returns False if it is not here."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
            self._free(req)
        else:
            self._waiting.remove(req)
        self.stats.request_success_total["abort"] += 1
        self._refresh_gauges()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def local_prefix_blocks(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Prompt blocks this engine holds now (HBM, host tier or pool; at most prompt − 1 tokens' worth)."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, cache_salt)
        return sum(self.cache.match(hashes, (len(prompt_token_ids) - 1) // self.block_size))

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept; False if it holds none (released, expired)."""
        req = self._held.pop(request_id, None)
        if req is None:
            return False
        self._free(req)
        self._refresh_gauges()
        return True

    @property
    def held_request_ids(self) -> list[str]:
        """Finished requests whose blocks are kept for a remote decode, oldest first."""
        return list(self._held)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks, as in vLLM."""
        if self._running or self._held:
            return False
        self.cache.reset()
        return True

    # -- time and energy -----------------------------------------------------------------
    def energy_j(self, now_s: float) -> float:
        """Joules since the first request arrived: idle power over the whole span plus dynamic energy."""
        if self._start_s is None:
            return 0.0
        return self.backend.idle_power_w * max(now_s - self._start_s, 0.0) + self._dynamic_energy_j

    def power_w(self, now_s: float) -> float:
        """Power draw at ``now_s``: the running step's, or idle between steps, W."""
        step = self._last_step
        if step is not None and step.start_s <= now_s < step.end_s:
            return self.backend.power_w(step.utilisation)
        return self.backend.idle_power_w

    # -- the step ------------------------------------------------------------------------
    def step(self, now_s: float) -> StepResult:
        """Schedule and run one batch starting at ``now_s`` (engine seconds).

        Returns:
            The step's duration, timing breakdown and one `RequestOutput` per request that
            produced a token; outputs take effect at ``result.end_s``.

        Raises:
            RuntimeError: called with nothing to do (check `has_unfinished` first).
        """
        if not self._requests:
            raise RuntimeError("step() with no unfinished requests")
        budget = self.config.max_num_batched_tokens
        work: list[tuple[EngineRequest, int]] = []  # (request, tokens scheduled this step)
        host_bytes = kv_pool_bytes = 0.0
        for req in list(self._running):
            if req not in self._running:
                continue  # preempted earlier in this loop
            tokens = min(req.prefill_target - req.computed, budget) if req.prefilling else 1
            if tokens <= 0 or not self._grow(req, tokens, work):
                continue
            work.append((req, tokens))
            budget -= tokens
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            admitted = self._admit(self._waiting[0], budget)
            if admitted is None:
                break
            req, tokens, host_loaded, pool_loaded = admitted
            if req.scheduled_s is None:
                req.scheduled_s = now_s
            self._waiting.popleft()
            self._running.append(req)
            work.append((req, tokens))
            budget -= tokens
            host_bytes += host_loaded
            kv_pool_bytes += pool_loaded
        if not work:
            raise RuntimeError("no request could be scheduled (KV cache too small for the head of the queue)")
        return self._run(now_s, work, host_bytes, kv_pool_bytes)

    def _admit(self, req: EngineRequest, budget: int) -> tuple[EngineRequest, int, float, float] | None:
        """Find the prefix hit, reference it, allocate the first chunk; None if KV is short.

        Returns the request, its tokens this step and the KV bytes it loads from the host
        tier and from the pool.
        """
        max_hit_blocks = (req.prefill_target - 1) // self.block_size
        hbm_blocks, host_blocks, kv_pool_blocks = self.cache.match(req.hashes, max_hit_blocks)
        hit = req.hashes[: hbm_blocks + host_blocks + kv_pool_blocks]
        local_tokens = len(hit) * self.block_size
        # Pulled from a remote engine (P/D): all but the last token is computed (vLLM recomputes it).
        remote = not req.admitted and req.remote_from_block is not None and len(hit) >= req.remote_from_block
        computed = req.prefill_target - 1 if remote else local_tokens
        tokens = min(req.prefill_target - computed, budget)
        need = math.ceil((computed + tokens) / self.block_size) - len(hit)
        free = self.cache.num_free_blocks
        # The prefix uses up between 0 and len(hit) free blocks: count it only when that decides.
        if need > free or (need + len(hit) > free and self.cache.blocks_needed_to_admit(hit) + need > free):
            return None  # KV is short: the request waits, and the cache is left as it was
        loaded = self.cache.acquire_cached(hit)
        if self.kv_events is not None and loaded:  # host-tier and pool blocks are cached in HBM now
            self.kv_events.gpu_cached(req.event_chain, req.hashes, loaded)
        self.cache.allocate_anonymous(need)
        req.held_hashes = list(hit)
        req.computed = computed
        req.anonymous_blocks = need
        if remote:  # the pulled full blocks are this engine's cached blocks from now on
            self._seal_full_blocks(req, local_tokens)
        if not req.admitted:  # the client is told the first admission's hit (vLLM num_cached_tokens)
            req.admitted = True
            req.cached_tokens = req.computed
            req.cached_host_tokens = host_blocks * self.block_size
            req.cached_kv_pool_tokens = kv_pool_blocks * self.block_size
        s = self.stats
        pulled_tokens = req.prompt_len - local_tokens if remote else 0  # vLLM's num_external_computed_tokens
        loaded_tokens = (host_blocks + kv_pool_blocks) * self.block_size + pulled_tokens
        s.prefix_cache_queries_tokens += req.prefill_target
        s.prefix_cache_hits_tokens += local_tokens
        if self.cache.num_host_blocks or self.cache.kv_pool is not None or remote:
            s.external_prefix_cache_queries_tokens += req.prompt_len - hbm_blocks * self.block_size
            s.external_prefix_cache_hits_tokens += loaded_tokens
        s.prompt_tokens_by_source["local_compute"] += req.prefill_target - req.computed
        s.prompt_tokens_by_source["local_cache_hit"] += hbm_blocks * self.block_size
        s.prompt_tokens_by_source["external_kv_transfer"] += loaded_tokens
        return req, tokens, host_blocks * self.block_bytes, kv_pool_blocks * self.block_bytes

    def _grow(self, req: EngineRequest, tokens: int, scheduled: list[tuple[EngineRequest, int]]) -> bool:
        """Allocate blocks for ``tokens`` more tokens, preempting the newest running requests if needed."""
        need = -(-(req.computed + tokens) // self.block_size) - req.blocks_held
        if need <= 0:  # most decode steps: the last block still has room
            return True
        while True:
            try:
                self.cache.allocate_anonymous(need)
                req.anonymous_blocks += need
                return True
            except OutOfBlocks:
                victim = self._running[-1]
                self._preempt(victim, scheduled)
                if victim is req:
                    return False

    def _preempt(self, req: EngineRequest, scheduled: list[tuple[EngineRequest, int]]) -> None:
        self._running.remove(req)
        self._free(req)
        # Recompute preemption (vLLM v1): prompt and generated tokens are prefilled again.
        req.prefill_target = max(req.prompt_len, req.prompt_len + req.generated - 1)
        req.computed = 0
        scheduled[:] = [(r, t) for r, t in scheduled if r is not req]
        self._waiting.appendleft(req)
        self.stats.num_preemptions_total += 1

    def _free(self, req: EngineRequest) -> None:
        self.cache.release(req.held_hashes, req.anonymous_blocks)
        req.held_hashes, req.anonymous_blocks = [], 0

    def _run(self, now_s: float, work: list[tuple[EngineRequest, int]], host_bytes: float, kv_pool_bytes: float) -> StepResult:
        model, backend = self.backend.model, self.backend
        flops = kv_read = 0.0
        prefill_tokens = decode_tokens = 0
        for req, tokens in work:
            context = req.computed
            flops += kappa.prefill_flops(model, context, tokens)
            kv_read += kappa.kv_bytes(model, context)
            if req.prefilling:
                prefill_tokens += tokens
            else:
                decode_tokens += tokens
        weights_read = weights_read_bytes(model, prefill_tokens + decode_tokens)
        step = roofline(backend, flops=flops, hbm_bytes=weights_read + kv_read, host_load_bytes=host_bytes,
                        kv_pool_load_bytes=kv_pool_bytes)
        duration, utilisation = step.duration_s, step.utilisation
        self._dynamic_energy_j += (backend.power_w(utilisation) - backend.idle_power_w) * duration
        outputs = tuple(out for req, tokens in work if (out := self._advance(req, tokens)) is not None)
        self.stats.host_kv_loaded_bytes_total += host_bytes
        self.stats.kv_pool_loaded_bytes_total += kv_pool_bytes
        self._refresh_gauges()
        result = StepResult(now_s, duration, outputs, step.compute_s, step.hbm_s, step.load_s, host_bytes,
                            prefill_tokens, decode_tokens, utilisation, kv_pool_bytes)
        self._last_step = result
        return result

    def _advance(self, req: EngineRequest, tokens: int) -> RequestOutput | None:
        """Apply a step's progress to one request; the output it produced, if any."""
        before = req.computed
        req.computed += tokens
        if before < req.prefill_target:
            self._seal_full_blocks(req, before)
            if req.prefilling:
                return None
            if req.generated == 0:
                self.stats.prompt_tokens_total += req.prompt_len
        token_id = GENERATED_TOKEN_BASE + (req.prompt_len * 7919 + req.generated * 104729) % 50000
        req.generated += 1
        self.stats.generation_tokens_total += 1
        finished = req.generated >= req.max_tokens
        held_blocks = 0
        if finished:
            self._running.remove(req)
            if req.hold_kv:  # vLLM's request_finished → delay_free_blocks: a remote decode reads them
                self._held[req.request_id] = req
                held_blocks = req.blocks_held
            else:
                self._free(req)
            del self._requests[req.request_id]
            self.stats.request_success_total["length"] += 1
        return RequestOutput(req.request_id, (token_id,), req.prompt_len, req.cached_tokens,
                             req.cached_host_tokens, req.generated, finished, "length" if finished else None,
                             req.cached_kv_pool_tokens, req.scheduled_s, held_blocks)

    def _seal_full_blocks(self, req: EngineRequest, computed_before: int) -> None:
        """Name the prompt blocks this chunk completed by their hashes (they become cacheable)."""
        first = computed_before // self.block_size
        last = min(req.computed, req.prompt_len) // self.block_size
        start, stop = max(first, len(req.held_hashes)), min(last, len(req.hashes))
        newly_cached = []
        for i in range(start, stop):
            if self.cache.seal(req.hashes[i]):  # False: another request cached it meanwhile (one copy kept)
                newly_cached.append(i)
            req.held_hashes.append(req.hashes[i])
            req.anonymous_blocks -= 1
        if self.kv_events is not None:  # announced once per copy the cache keeps, so each eviction removes it
            self.kv_events.gpu_cached(req.event_chain, req.hashes, newly_cached)

    def _refresh_gauges(self) -> None:
        self.stats.num_requests_running = len(self._running)
        self.stats.num_requests_waiting = len(self._waiting)
        self.stats.kv_cache_usage_ratio = self.cache.usage_ratio
