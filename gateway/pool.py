"""The backend pool: health checks, vLLM metrics scraping, restart detection, the ledger.

Health: ``GET /health`` every ``health_interval_s``; one failure (or a connect error while
proxying) takes a backend out of the candidate set, one success brings it back.
Scraping: ``GET /metrics`` every ``scrape_interval_s`` (`gateway.scrape`): queue depth, KV
usage, block size and KV capacity from ``vllm:cache_config_info``, and
``process_start_time_seconds`` — when it changes, or the prefix-cache counters go
backwards, the backend restarted with an empty cache and the index forgets it.

The ledger is the gateway's own account of what it sent where, updated at decision time
(not after): in-flight requests, the KV bytes charged to them ((K+T+max_tokens)·B_kv) and
the predicted prefill seconds not yet past their first byte. A `Ticket` releases its
charges exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from gateway.scrape import BackendMetrics, parse_vllm_metrics
from gateway.settings import BackendEntry
from gateway.telemetry import Telemetry
from router import kappa
from router.calibration import KappaCritFit
from router.cost import BackendSpec

log = logging.getLogger("kappa_gateway.pool")

PROBE_TIMEOUT_S = 2.0
# Share of HBM vLLM may use by default (gpu_memory_utilization 0.9): KV capacity until a scrape says.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
VLLM_BLOCK_SIZE_TOKENS = 16  # vLLM's default --block-size, until a scrape reports the real one


@dataclass(eq=False)
class BackendState:
    """Everything the gateway knows about one backend. Mutated only by the pool and tickets."""

    entry: BackendEntry
    spec: BackendSpec
    healthy: bool = False
    metrics: BackendMetrics = field(default_factory=BackendMetrics)
    in_flight: int = 0
    kv_demand_bytes: float = 0.0
    outstanding_prefill_s: float = 0.0
    recorded_blocks: int = 0  # blocks recorded in the index for it (its "tree size"), approximate
    model_checked: bool = False  # its /v1/models listed the configured model (re-checked after a restart)
    kappa_fit: KappaCritFit = field(init=False)  # measured κ_crit from clean TTFT samples
    _kv_capacity: tuple[BackendMetrics, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.kappa_fit = KappaCritFit(predicted_kappa_crit=self.spec.kappa_crit)

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def kv_capacity_bytes(self) -> float:
        """KV memory: scraped num_gpu_blocks × block_size × B_kv, else the config's block override,
        else HBM × 0.9 − weights. Computed once per scrape (it is read for every request)."""
        m = self.metrics
        cached = self._kv_capacity
        if cached is not None and cached[0] is m:
            return cached[1]
        capacity = self._kv_capacity_of(m)
        self._kv_capacity = (m, capacity)
        return capacity

    def _kv_capacity_of(self, m: BackendMetrics) -> float:
        if m.num_gpu_blocks and m.block_size_tokens:
            return m.num_gpu_blocks * m.block_size_tokens * kappa.b_kv_bytes(self.spec.model)
        if self.entry.num_gpu_blocks_override:
            return self.entry.num_gpu_blocks_override * VLLM_BLOCK_SIZE_TOKENS * kappa.b_kv_bytes(self.spec.model)
        hbm = self.spec.hardware.hbm_bytes * self.spec.tensor_parallel * DEFAULT_GPU_MEMORY_UTILIZATION
        return max(hbm - self.spec.model.weight_bytes, 0.0)

    @property
    def host_tier_bytes(self) -> float:
        return self.entry.host_tier_gb * 1e9


class Ticket:
    """A request's charges on one backend; `first_byte` and `finish` are idempotent."""

    __slots__ = ("state", "kv_bytes", "prefill_s", "_on_finish", "_first", "_done")

    def __init__(self, state: BackendState, kv_bytes: float, prefill_s: float,
                 on_finish: Callable[[], None] | None = None) -> None:
        self.state, self.kv_bytes, self.prefill_s = state, kv_bytes, prefill_s
        self._on_finish = on_finish  # called once, when the request ends (however it ends)
        self._first = self._done = False
        state.in_flight += 1
        state.kv_demand_bytes += kv_bytes
        state.outstanding_prefill_s += prefill_s

    def first_byte(self) -> None:
        if not self._first:
            self._first = True
            self.state.outstanding_prefill_s = max(self.state.outstanding_prefill_s - self.prefill_s, 0.0)

    def finish(self) -> None:
        if self._done:
            return
        self.first_byte()
        self._done = True
        self.state.in_flight -= 1
        self.state.kv_demand_bytes = max(self.state.kv_demand_bytes - self.kv_bytes, 0.0)
        if self._on_finish is not None:
            self._on_finish()


class BackendPool:
    """Owns the backends' states and the background tasks that keep them fresh.

    Args:
        states: one per configured backend, in config order.
        session: an aiohttp session for probes (the caller owns and closes it).
        telemetry: where backend_up and κ_crit gauges go.
        on_restart: awaited with a backend id when it restarted (the index forgets it).
        health_interval_s, scrape_interval_s: probe periods, s.
    """

    def __init__(self, states: list[BackendState], session: aiohttp.ClientSession, telemetry: Telemetry, *,
                 on_restart: Callable[[str], Awaitable[None]], health_interval_s: float,
                 scrape_interval_s: float) -> None:
        self.states = states
        self.by_id = {s.id: s for s in states}
        self._session = session
        self._telemetry = telemetry
        self._on_restart = on_restart
        self._health_interval_s = health_interval_s
        self._scrape_interval_s = scrape_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        for s in states:
            telemetry.init_backend(s.id, s.spec.kappa_crit, in_flight=lambda s=s: s.in_flight,
                                   kv_demand_bytes=lambda s=s: s.kv_demand_bytes)

    def eligible(self, model: str) -> list[BackendState]:
        """Healthy backends serving ``model``, in config order."""
        return [s for s in self.states if s.healthy and s.entry.model == model]

    def serves(self, model: str) -> bool:
        return any(s.entry.model == model for s in self.states)

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states)

    def mark_down(self, state: BackendState, reason: str) -> None:
        """Passive ejection after a connect failure while proxying; the health loop restores it."""
        if state.healthy:
            log.warning("backend %s marked down: %s", state.id, reason)
        self._set_health(state, False)

    async def start(self) -> None:
        """Probe every backend once (so the first requests have candidates), then run the loops."""
        await asyncio.gather(*(self._probe(s) for s in self.states))
        await asyncio.gather(*(self._scrape(s) for s in self.states if s.healthy))
        self._tasks = [asyncio.create_task(self._loop(self._probe, self._health_interval_s), name="health"),
                       asyncio.create_task(self._loop(self._scrape, self._scrape_interval_s), name="scrape")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _loop(self, probe: Callable[[BackendState], Awaitable[None]], interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(probe(s) for s in self.states))

    async def _probe(self, state: BackendState) -> None:
        try:
            async with self._session.get(f"{state.entry.url}/health",
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                ok = resp.status == 200
            if ok and not state.model_checked:
                ok = await self._serves_configured_model(state)
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok and not state.healthy:
            log.info("backend %s is up", state.id)
        elif not ok and state.healthy:
            log.warning("backend %s failed its health check", state.id)
        self._set_health(state, ok)

    async def _serves_configured_model(self, state: BackendState) -> bool:
        """GET /v1/models once: a backend that lists other models only stays out of rotation.

        A backend without the route (404) cannot be checked and is trusted. Raises aiohttp or
        timeout errors to the caller (the probe counts them as a failed check).
        """
        async with self._session.get(f"{state.entry.url}/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            if resp.status == 404:
                state.model_checked = True
                return True
            if resp.status != 200:
                return False
            try:
                listed = {m.get("id") for m in (await resp.json(content_type=None)).get("data", [])}
            except (ValueError, AttributeError, TypeError):
                listed = set()
        if state.entry.model in listed:
            state.model_checked = True
            return True
        log.error("backend %s serves %s, not the configured model %r: kept out of rotation",
                  state.id, sorted(str(m) for m in listed) or "no models", state.entry.model)
        return False

    async def _scrape(self, state: BackendState) -> None:
        if not state.healthy:
            return
        try:
            async with self._session.get(f"{state.entry.url}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return
                metrics = parse_vllm_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", state.id, exc)
            return
        previous = state.metrics
        state.metrics = metrics
        if _restarted(previous, metrics):
            log.warning("backend %s restarted (process start time or counters reset): forgetting its index entries",
                        state.id)
            state.model_checked = False
            await self._on_restart(state.id)

    def _set_health(self, state: BackendState, healthy: bool) -> None:
        state.healthy = healthy
        self._telemetry.backend_up.labels(state.id).set(1 if healthy else 0)


def _restarted(previous: BackendMetrics, current: BackendMetrics) -> bool:
    if previous.process_start_time_s is None:
        return False
    if current.process_start_time_s is not None and current.process_start_time_s != previous.process_start_time_s:
        return True
    return current.prefix_cache_queries_tokens < previous.prefix_cache_queries_tokens
