"""Discrete-event fleet simulator in virtual time: a trace, the real router and index, mock engines.

Each arrival is routed by the code the live gateway runs (`gateway.routing`, DESIGN.md §1
steps 2–4): the prompt's chained block hashes (`sim.prompts`, computed as the gateway
does), `prefix_index.MemoryPrefixIndex.match` against every backend's `TierCapacity`,
one `router.types.BackendView` per backend, `router.decide.decide`. Each backend is a
`mock_vllm.engine.MockEngine` that serves in virtual time.

What the router sees is only what it would see live (DESIGN.md §2):
- its own index, recorded when a request's first token comes back (as the gateway records
  after the first byte), with capacities from the scraped KV size and its bytes/token
  estimate (`router.calibration.BytesPerToken`, fed each finished request's prompt tokens),
  overlaid with the chains of its requests in flight (`prefix_index.PendingChains`, held
  in HBM on their backend from the decision to the finish, as the gateway does);
- its own ledger, charged at decision time — in-flight count, (K+T+max_tokens)·B_kv of KV
  demand, predicted prefill seconds — with the prefill released at the first token and the
  rest at the finish (`gateway.pool.Ticket`);
- engine metrics (queue depth, running, KV usage) from a snapshot refreshed only at scrape
  times t0 + k·``scrape_interval_s``, never the engines' live state.

Events, in virtual seconds: arrivals (from the trace), engine step ends, scrapes. An engine
runs its steps back to back while it has work: the next step starts when the previous one
ends; an idle engine starts one at the arrival time. At one instant, events go in this
order: scrapes due strictly before it, step ends (their outputs: first tokens, finishes),
a scrape due at it, arrivals (in trace order), then every idle engine with work starts a
step — so requests arriving together are batched together. The run is deterministic for a
seed (the policies' tie-breaks draw from ``random.Random(seed)``).

The prefix index's coroutines never suspend (`MemoryPrefixIndex` has no I/O), so they are
driven to completion with one ``send(None)`` instead of an event loop.

Energy: every backend is powered from the first arrival to the last finish; each engine's
``energy_j`` plus its idle draw before its first request.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mock_vllm.engine import MockEngine, PromptTooLong
from mock_vllm.kv_cache import SharedKVPool
from mock_vllm.types import StepResult
from prefix_index import POOL_ID, BlockMatch, MemoryPrefixIndex, PendingChains, TierCapacity, pool_capacity, with_pool
from router import kappa
from router.calibration import BytesPerToken
from router.decide import decide
from router.policies import Policy
from router.types import BackendView, Decision, RequestFeatures
from sim.fleet import Fleet, SimBackend
from sim.prompts import PreparedRequest, token_ids

T = TypeVar("T")
_NO_MATCH = BlockMatch(0, 0, 0)


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """What the router was given and what it chose, for an observer (tests, traces of decisions)."""

    now_s: float
    request_index: int
    features: RequestFeatures
    views: tuple[BackendView, ...]
    decision: Decision


DecisionObserver = Callable[[DecisionEvent], None]


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times in virtual seconds; token counts as the engine reported them.

    ``kappa_ratio``, ``kappa_crit``, ``regime`` and ``predicted_ttft_s`` are the chosen
    candidate's figures at decision time (what the gateway puts in its x-kappa-* headers).
    """

    index: int
    arrival_s: float
    backend_id: str
    max_tokens: int
    kappa_ratio: float
    kappa_crit: float
    regime: str
    predicted_ttft_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    cached_pool_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's run over one trace and fleet.

    Args:
        policy: the policy's name.
        records: one per routed request, by trace index.
        rejected: trace indexes the chosen backend refused (prompt + max_tokens over its context),
            answered with an error as the gateway would relay vLLM's 400; not in ``records``.
        start_s, end_s: first arrival and last finish, s.
        energy_j: joules per backend id over [start_s, end_s], idle included.
        backends: the fleet's backends, in config order.
        wall_s: wall-clock seconds the run took.
    """

    policy: str
    records: list[RequestRecord]
    rejected: list[int]
    start_s: float
    end_s: float
    energy_j: dict[str, float]
    backends: tuple[SimBackend, ...]
    wall_s: float


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends, without an event loop.

    Raises:
        RuntimeError: the coroutine suspended (it needs real I/O; use an event loop).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("coroutine suspended: the simulator needs a prefix index that never awaits")


class _Backend:
    """One backend's engine plus the gateway's knowledge of it (ledger, scrape, index size)."""

    __slots__ = ("config", "engine", "kv_capacity_bytes", "host_tier_bytes", "in_flight", "kv_demand_bytes",
                 "outstanding_prefill_s", "recorded_blocks", "waiting", "running", "kv_usage", "step",
                 "first_add_s")

    def __init__(self, config: SimBackend, pool: SharedKVPool | None = None) -> None:
        self.config = config
        self.engine = MockEngine(config.spec, config.engine, pool)
        stats = self.engine.stats
        # What the gateway learns from vllm:cache_config_info at its first scrape (static).
        self.kv_capacity_bytes = stats.num_gpu_blocks * self.engine.block_size * kappa.b_kv_bytes(config.spec.model)
        self.host_tier_bytes = config.host_tier_bytes
        self.in_flight = 0
        self.kv_demand_bytes = 0.0
        self.outstanding_prefill_s = 0.0
        self.recorded_blocks = 0
        self.waiting = self.running = 0
        self.kv_usage = 0.0
        self.step: StepResult | None = None
        self.first_add_s: float | None = None

    def scrape(self) -> None:
        stats = self.engine.stats
        self.waiting, self.running, self.kv_usage = (stats.num_requests_waiting, stats.num_requests_running,
                                                     stats.kv_cache_usage_ratio)


class _Active:
    """A request between decision and finish: its record and its charges on the ledger."""

    __slots__ = ("record", "kv_bytes", "prefill_s", "hashes", "prompt_bytes")

    def __init__(self, record: RequestRecord, kv_bytes: float, prefill_s: float, hashes: Sequence[int],
                 prompt_bytes: int) -> None:
        self.record, self.kv_bytes, self.prefill_s = record, kv_bytes, prefill_s
        self.hashes, self.prompt_bytes = hashes, prompt_bytes


class Simulator:
    """One run: a fleet, a policy, a prepared trace.

    Args:
        fleet: the backends and gateway settings.
        policy: a fresh policy object (`router.policies.build_policy`); it keeps state.
        requests: the prepared trace (`sim.prompts.prepare_trace` with this fleet's block size).
        seed: seeds the policies' tie-breaks.
        model: the served model every request asks for (default: the fleet's first).
        observer: called with every decision's inputs and output.

    Raises:
        ValueError: no backend serves ``model``.
    """

    def __init__(self, fleet: Fleet, policy: Policy, requests: Sequence[PreparedRequest], *, seed: int = 0,
                 model: str | None = None, observer: DecisionObserver | None = None) -> None:
        self.fleet, self.policy, self.requests, self.observer = fleet, policy, requests, observer
        self.model = model or fleet.served_models()[0]
        served = [b for b in fleet.backends if b.model == self.model]
        if not served:
            raise ValueError(f"no backend serves model {self.model!r}")
        # The KV store the backends share, sized in the engines' 16-token blocks (as the mock fleet does).
        self._kv_pool = None if fleet.pool_bytes is None else SharedKVPool.with_capacity(
            fleet.pool_bytes, kappa.b_kv_bytes(served[0].spec.model) * served[0].engine.block_size_tokens)
        self._backends = [_Backend(b, self._kv_pool) for b in served]
        self._by_id = {b.config.id: b for b in self._backends}
        self._position = {b.config.id: i for i, b in enumerate(self._backends)}
        self._index = MemoryPrefixIndex()
        self._pending = PendingChains()
        self._rng = random.Random(seed)
        self._calibration = BytesPerToken(fleet.bytes_per_token)
        self._block_bytes = fleet.block_size_bytes
        self._b_kv = kappa.b_kv_bytes(self._backends[0].config.spec.model)
        self._active: dict[str, _Active] = {}
        self._records: dict[int, RequestRecord] = {}
        self._rejected: list[int] = []

    # -- the event loop --------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate every request to its finish. May be called once."""
        started = time.perf_counter()
        reqs = sorted(self.requests, key=lambda r: (r.arrival_s, r.index))
        n = len(reqs)
        t0 = reqs[0].arrival_s if reqs else 0.0
        interval = self.fleet.scrape_interval_s
        for b in self._backends:
            b.scrape()
        next_scrape = t0 + interval
        steps: list[tuple[float, int]] = []  # (end_s, backend position): at most one per backend
        i = 0
        while i < n or steps:
            now = steps[0][0] if steps else math.inf
            if i < n and reqs[i].arrival_s < now:
                now = reqs[i].arrival_s
            if next_scrape < now:  # nothing happened since that scrape time: the state is as it was
                self._scrape_all()
                next_scrape = _next_grid_point(t0, interval, now)
            kick: list[int] = []
            while steps and steps[0][0] == now:
                _, pos = heapq.heappop(steps)
                self._step_end(self._backends[pos], now)
                kick.append(pos)
            if next_scrape == now:
                self._scrape_all()
                next_scrape += interval
            while i < n and reqs[i].arrival_s == now:
                pos = self._arrive(reqs[i], now)
                if pos is not None:
                    kick.append(pos)
                i += 1
            for pos in sorted(set(kick)):
                b = self._backends[pos]
                if b.step is None and b.engine.has_unfinished():
                    b.step = b.engine.step(now)
                    heapq.heappush(steps, (b.step.end_s, pos))
        end = max((r.finish_s for r in self._records.values() if r.finish_s is not None), default=t0)
        energy = {}
        for b in self._backends:
            idle_before = b.config.spec.idle_power_w * ((b.first_add_s if b.first_add_s is not None else end) - t0)
            energy[b.config.id] = b.engine.energy_j(end) + idle_before
        records = [self._records[k] for k in sorted(self._records)]
        return SimResult(self.policy.name, records, self._rejected, t0, end, energy,
                         tuple(b.config for b in self._backends), time.perf_counter() - started)

    def _scrape_all(self) -> None:
        for b in self._backends:
            b.scrape()

    # -- routing (gateway.routing.RoutingService.plan / charge) -----------------------------
    def _capacity(self, b: _Backend, block_kv_bytes: float) -> TierCapacity:
        return TierCapacity(int(b.kv_capacity_bytes // block_kv_bytes), int(b.host_tier_bytes // block_kv_bytes))

    def _pool_capacity(self, block_kv_bytes: float) -> TierCapacity | None:
        return None if self.fleet.pool_bytes is None else pool_capacity(self.fleet.pool_bytes, block_kv_bytes)

    def _block_kv_bytes(self) -> float:
        return self._block_bytes / self._calibration.get(self.model) * self._b_kv

    def _arrive(self, req: PreparedRequest, now: float) -> int | None:
        """Route one request and hand it to the chosen engine; its backend's position, or None."""
        model = self.model
        bytes_per_token = self._calibration.get(model)
        tokens_per_block = self._block_bytes / bytes_per_token
        block_kv = tokens_per_block * self._b_kv
        capacities = {b.config.id: self._capacity(b, block_kv) for b in self._backends}
        pool = self._pool_capacity(block_kv)
        lookup = capacities if pool is None else {**capacities, POOL_ID: pool}
        hashes = req.hashes
        matches = run_now(self._index.match(model, hashes, lookup)) if len(hashes) else {}
        matches = self._pending.overlay(model, hashes, matches, lookup)
        if pool is not None:
            matches = with_pool(matches, capacities)
        features = RequestFeatures(model=model, prompt_tokens=max(round(req.prompt_bytes / bytes_per_token), 1),
                                   max_tokens=req.max_tokens, prompt_blocks=len(hashes),
                                   block_size_tokens=tokens_per_block)
        views = []
        for b in self._backends:
            bid = b.config.id
            m = matches.get(bid, _NO_MATCH)
            views.append(BackendView(
                backend_id=bid, spec=b.config.spec,
                matched_blocks=m.matched_blocks, hbm_blocks=m.hbm_blocks, host_blocks=m.host_blocks,
                pool_blocks=m.pool_blocks, in_flight_blocks=m.in_flight_blocks, cached_blocks=min(b.recorded_blocks, capacities[bid].total_blocks),
                in_flight=b.in_flight, kv_demand_bytes=b.kv_demand_bytes,
                outstanding_prefill_s=b.outstanding_prefill_s, kv_capacity_bytes=b.kv_capacity_bytes,
                num_requests_waiting=b.waiting, num_requests_running=b.running, kv_cache_usage_ratio=b.kv_usage))
        decision = decide(self.policy, features, views, self._rng)
        if self.observer is not None:
            self.observer(DecisionEvent(now, req.index, features, tuple(views), decision))
        cand = decision.chosen
        b = self._by_id[cand.backend_id]
        rid = str(req.index)
        try:
            b.engine.add_request(rid, token_ids(req), max_tokens=req.max_tokens, arrival_s=now)
        except PromptTooLong:  # a 400 from the backend: the gateway relays it, retries only 5xx
            self._rejected.append(req.index)
            return None
        est = cand.estimate
        record = RequestRecord(req.index, now, cand.backend_id, req.max_tokens, est.kappa_ratio, est.kappa_crit,
                               est.regime.value, est.ttft_s)
        self._records[req.index] = record
        self._active[rid] = _Active(record, est.kv_demand_bytes, est.prefill_s, hashes, req.prompt_bytes)
        b.in_flight += 1
        b.kv_demand_bytes += est.kv_demand_bytes
        b.outstanding_prefill_s += est.prefill_s
        self._pending.add(model, cand.backend_id, hashes)
        if b.first_add_s is None:
            b.first_add_s = now
        return self._position[cand.backend_id]

    # -- engine outputs (gateway.proxy: first byte, record, finish, usage) ------------------
    def _step_end(self, b: _Backend, now: float) -> None:
        step, b.step = b.step, None
        assert step is not None
        for out in step.outputs:
            act = self._active[out.request_id]
            record = act.record
            if record.first_token_s is None:
                record.first_token_s = now
                record.prompt_tokens, record.cached_tokens = out.prompt_tokens, out.cached_tokens
                record.cached_host_tokens = out.cached_host_tokens
                record.cached_pool_tokens = out.cached_pool_tokens
                b.outstanding_prefill_s = max(b.outstanding_prefill_s - act.prefill_s, 0.0)
                if len(act.hashes):
                    block_kv = self._block_kv_bytes()
                    run_now(self._index.record(self.model, b.config.id, act.hashes, self._capacity(b, block_kv)))
                    b.recorded_blocks += len(act.hashes)
                    pool = self._pool_capacity(block_kv)
                    if pool is not None:  # the backend wrote the chain through to the shared pool
                        run_now(self._index.record(self.model, POOL_ID, act.hashes, pool))
            if out.finished:
                record.finish_s = now
                self._pending.remove(self.model, b.config.id, act.hashes)
                b.in_flight -= 1
                b.kv_demand_bytes = max(b.kv_demand_bytes - act.kv_bytes, 0.0)
                self._calibration.observe(self.model, act.prompt_bytes, out.prompt_tokens)
                del self._active[out.request_id]


def _next_grid_point(t0: float, interval: float, now: float) -> float:
    """The first scrape time t0 + k·interval at or after ``now``."""
    point = t0 + math.ceil((now - t0) / interval) * interval
    while point < now:
        point += interval
    return point


def simulate(fleet: Fleet, policy: Policy, requests: Sequence[PreparedRequest], *, seed: int = 0,
             observer: DecisionObserver | None = None) -> SimResult:
    """Run ``requests`` through ``fleet`` under ``policy`` (see `Simulator`)."""
    return Simulator(fleet, policy, requests, seed=seed, observer=observer).run()
