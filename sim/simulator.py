"""Discrete-event fleet simulator in virtual time: a trace, the real router and index, mock engines.

Each arrival is routed by the pipeline the live gateway runs, `dispatch.Dispatcher`
(DESIGN.md §1 steps 3–4 and its bookkeeping): the prompt's chained block hashes
(`sim.prompts`, computed as the gateway does), one `prefix_index.MemoryPrefixIndex` match
against every backend, the in-flight and pool overlays, one `router.types.BackendView` per
backend, `router.decide.decide`, then a `dispatch.Ticket` on the chosen backend's ledger.
Each backend is a `mock_vllm.engine.MockEngine` that serves in virtual time; this module
keeps only the clock and the engines.

What the router sees is only what it would see live (DESIGN.md §2):
- its own index, recorded when a request's first token comes back (as the gateway records
  after the first byte), with capacities from the scraped KV size and its bytes/token
  estimate (`router.calibration.BytesPerToken`, fed each finished request's prompt tokens),
  overlaid with the chains of its requests in flight (`prefix_index.PendingChains`, held
  in HBM on their backend from the decision to the finish, as the gateway does);
- its own ledger, charged at decision time — in-flight count, (K+T+max_tokens)·B_kv of KV
  demand, predicted prefill seconds — with the prefill released at the first token and the
  rest at the finish (`dispatch.Ticket`, as the gateway's relay settles it);
- engine metrics (queue depth, running, KV usage, KV blocks) as a `dispatch.BackendMetrics`
  snapshot refreshed only at scrape times t0 + k·``scrape_interval_s``, never the engines'
  live state.

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
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from dispatch import BackendMetrics, RoutableRequest, Target, Ticket
from mock_vllm.engine import MockEngine, PromptTooLong
from mock_vllm.kv_cache import SharedKVPool
from mock_vllm.types import StepResult
from prefix_index import MemoryPrefixIndex
from router.capacity import kv_block_bytes
from router.policies import Policy
from router.types import BackendView, Decision, RequestFeatures
from sim.fleet import Fleet, SimBackend
from sim.prompts import PreparedRequest, token_ids
from sim.replicas import Replica, Spreader, Topology, build_replicas, sync_peers

T = TypeVar("T")


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

    ``kappa_ratio``, ``kappa_ratio_loaded``, ``kappa_crit``, ``regime`` and ``predicted_ttft_s``
    are the chosen candidate's figures at decision time (what the gateway puts in its
    x-kappa-* headers; names as in `router.kappa`).
    """

    index: int
    arrival_s: float
    backend_id: str
    max_tokens: int
    kappa_ratio: float
    kappa_ratio_loaded: float
    kappa_crit: float
    regime: str
    predicted_ttft_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    cached_kv_pool_tokens: int = 0
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


class _Engine:
    """One backend's engine, its step in progress and when it got its first request."""

    __slots__ = ("engine", "config", "step", "first_add_s")

    def __init__(self, config: SimBackend, kv_pool: SharedKVPool | None = None) -> None:
        self.engine = MockEngine(config.spec, config.engine, kv_pool)
        self.config = config
        self.step: StepResult | None = None
        self.first_add_s: float | None = None


class _Backend(Target):
    """What one gateway replica knows of one engine (a `dispatch.Target`)."""

    def __init__(self, engine: _Engine) -> None:
        config, stats = engine.config, engine.engine.stats
        super().__init__(config.id, config.spec, host_tier_bytes=config.host_tier_bytes,
                         num_gpu_blocks_override=config.engine.num_gpu_blocks_override,
                         metrics=BackendMetrics(block_size_tokens=engine.engine.block_size,
                                                num_gpu_blocks=stats.num_gpu_blocks))
        self.source = engine

    def scrape(self) -> None:
        """What a scrape of vLLM's /metrics would read now."""
        stats = self.source.engine.stats
        self.scraped(replace(self.metrics, num_requests_waiting=stats.num_requests_waiting,
                             num_requests_running=stats.num_requests_running,
                             kv_cache_usage_ratio=stats.kv_cache_usage_ratio))


class _Active:
    """A request between decision and finish: its record, its ticket, what calibration needs,
    and the replica that routed it (which records its chain and calibrates from it)."""

    __slots__ = ("record", "ticket", "request", "replica")

    def __init__(self, record: RequestRecord, ticket: Ticket, request: RoutableRequest, replica: Replica) -> None:
        self.record, self.ticket, self.request, self.replica = record, ticket, request, replica


class Simulator:
    """One run: a fleet, a policy, a prepared trace.

    Args:
        fleet: the backends and gateway settings.
        policy: a fresh policy object (`router.policies.build_policy`); it keeps state.
        requests: the prepared trace (`sim.prompts.prepare_trace` with this fleet's block size).
        seed: seeds the policies' tie-breaks.
        model: the served model every request asks for (default: the fleet's first).
        observer: called with every decision's inputs and output.
        topology: gateway replicas, what they share, the index's write-to-read lag
            (`sim.replicas.Topology`; default: one gateway, records visible at once).
        client_concurrency: most requests the client keeps in flight (``None``: no limit). An
            arrival beyond it waits, client-side and FIFO, for a request to end, and is sent
            then, as `gateway.commands.replay` does (``--concurrency``): its record's arrival is
            the send, so latencies run from the send there too.

    Raises:
        ValueError: no backend serves ``model``.
    """

    def __init__(self, fleet: Fleet, policy: Policy, requests: Sequence[PreparedRequest], *, seed: int = 0,
                 model: str | None = None, observer: DecisionObserver | None = None,
                 topology: Topology = Topology(), client_concurrency: int | None = None) -> None:
        if client_concurrency is not None and client_concurrency < 1:
            raise ValueError(f"client_concurrency must be >= 1, got {client_concurrency}")
        self.client_concurrency = client_concurrency
        self.fleet, self.policy, self.requests, self.observer = fleet, policy, requests, observer
        self.model = model or fleet.served_models()[0]
        served = [b for b in fleet.backends if b.model == self.model]
        if not served:
            raise ValueError(f"no backend serves model {self.model!r}")
        # The KV store the backends share, sized in the engines' blocks (as the mock fleet does).
        self._kv_pool = None if fleet.kv_pool_bytes is None else SharedKVPool.with_capacity(
            fleet.kv_pool_bytes, kv_block_bytes(served[0].spec, served[0].engine.block_size_tokens))
        self._engines = [_Engine(b, self._kv_pool) for b in served]
        self._position = {e.config.id: i for i, e in enumerate(self._engines)}
        self.topology = topology
        self._replicas = build_replicas(topology, MemoryPrefixIndex(), policy, seed,
                                        make_targets=lambda: [_Backend(e) for e in self._engines],
                                        bytes_per_token=fleet.bytes_per_token,
                                        block_size_bytes=fleet.block_size_bytes, kv_pool_bytes=fleet.kv_pool_bytes)
        self._targets = [t for r in self._replicas for t in r.targets]  # every view, scraped together
        self._spreader = Spreader(topology, seed)
        self._records_due: list[tuple[float, int, Replica, Target, Sequence[int], Any]] = []  # writes in flight
        self._write_seq = itertools.count()
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
        self._t0 = self._next_sync_s = t0
        interval = self.fleet.scrape_interval_s
        self._scrape_all()
        next_scrape = t0 + interval
        steps: list[tuple[float, int]] = []  # (end_s, backend position): at most one per backend
        held: deque[PreparedRequest] = deque()  # arrived, waiting client-side for a free slot
        cap = self.client_concurrency
        i = 0
        while i < n or steps or held:
            now = steps[0][0] if steps else math.inf
            if i < n and reqs[i].arrival_s < now:
                now = reqs[i].arrival_s
            if next_scrape < now:  # nothing happened since that scrape time: the state is as it was
                self._scrape_all()
                next_scrape = _next_grid_point(t0, interval, now)
            kick: list[int] = []
            while steps and steps[0][0] == now:
                _, pos = heapq.heappop(steps)
                self._step_end(self._engines[pos], now)
                kick.append(pos)
            if next_scrape == now:
                self._scrape_all()
                next_scrape += interval
            self._apply_records(now)
            while i < n and reqs[i].arrival_s == now:
                held.append(reqs[i])
                i += 1
            while held and (cap is None or len(self._active) < cap):
                pos = self._arrive(held.popleft(), now)
                if pos is not None:
                    kick.append(pos)
            for pos in sorted(set(kick)):
                b = self._engines[pos]
                if b.step is None and b.engine.has_unfinished():
                    b.step = b.engine.step(now)
                    heapq.heappush(steps, (b.step.end_s, pos))
        end = max((r.finish_s for r in self._records.values() if r.finish_s is not None), default=t0)
        energy = {}
        for b in self._engines:
            idle_before = b.config.spec.idle_power_w * ((b.first_add_s if b.first_add_s is not None else end) - t0)
            energy[b.config.id] = b.engine.energy_j(end) + idle_before
        records = [self._records[k] for k in sorted(self._records)]
        return SimResult(self.policy.name, records, self._rejected, t0, end, energy,
                         tuple(b.config for b in self._engines), time.perf_counter() - started)

    def _scrape_all(self) -> None:
        for target in self._targets:
            target.scrape()  # type: ignore[attr-defined]  # every target here is a _Backend

    def _record(self, replica: Replica, target: Target, hashes: Sequence[int], now: float, *,
                holders: Literal["both", "backend", "kv_pool"]) -> None:
        """Tell the shared index ``target`` (and/or the pool) caches ``hashes``: visible
        ``index_lag_s`` from ``now`` (`dispatch.Dispatcher.record`'s ``holders``)."""
        if self.topology.index_lag_s == 0:
            run_now(replica.dispatch.record(self.model, target, hashes, holders=holders))
        else:
            heapq.heappush(self._records_due, (now + self.topology.index_lag_s, next(self._write_seq), replica,
                                               target, hashes, holders))

    def _apply_records(self, now: float) -> None:
        """Index writes that became visible by ``now`` (``topology.index_lag_s`` after their first token)."""
        due = self._records_due
        while due and due[0][0] <= now:
            _, _, replica, target, hashes, holders = heapq.heappop(due)
            run_now(replica.dispatch.record(self.model, target, hashes, holders=holders))

    # -- routing: the gateway's pipeline (dispatch) ---------------------------------------
    def _arrive(self, req: PreparedRequest, now: float) -> int | None:
        """Route one request and hand it to the chosen engine; its backend's position, or None."""
        request = RoutableRequest(self.model, req.hashes, req.prompt_bytes, req.max_tokens)
        replica = self._replicas[self._spreader.pick()]
        if self.topology.state == "synced" and (now >= self._next_sync_s or not self.topology.sync_interval_s):
            sync_peers(self._replicas)  # the state as of now, at most one sync interval late
            every = self.topology.sync_interval_s
            if every:
                self._next_sync_s = self._t0 + (math.floor((now - self._t0) / every) + 1) * every
        plan = run_now(replica.dispatch.plan(request, replica.targets))
        if self.observer is not None:
            self.observer(DecisionEvent(now, req.index, plan.features, plan.views, plan.decision))
        cand = plan.decision.chosen
        b = self._engines[self._position[cand.backend_id]]
        rid = str(req.index)
        try:
            b.engine.add_request(rid, token_ids(req), max_tokens=req.max_tokens, arrival_s=now)
        except PromptTooLong:  # a 400 from the backend: the gateway relays it, retries only 5xx
            self._rejected.append(req.index)
            return None
        est = cand.estimate
        record = RequestRecord(req.index, now, cand.backend_id, req.max_tokens, est.kappa_ratio, est.kappa_ratio_loaded,
                               est.kappa_crit, est.regime.value, est.ttft_s)
        self._records[req.index] = record
        self._active[rid] = _Active(record, replica.dispatch.charge(plan, cand), request, replica)
        if self.topology.record_at_decision:
            self._record(replica, replica.by_id[cand.backend_id], request.hashes, now, holders="backend")
        if b.first_add_s is None:
            b.first_add_s = now
        return self._position[cand.backend_id]

    # -- engine outputs (the gateway's relay: first byte, record, finish, usage) ------------
    def _step_end(self, b: _Engine, now: float) -> None:
        step, b.step = b.step, None
        assert step is not None
        for out in step.outputs:
            act = self._active[out.request_id]
            record = act.record
            if record.first_token_s is None:
                record.first_token_s = now
                record.prompt_tokens, record.cached_tokens = out.prompt_tokens, out.cached_tokens
                record.cached_host_tokens = out.cached_host_tokens
                record.cached_kv_pool_tokens = out.cached_kv_pool_tokens
                act.ticket.first_byte()
                self._record(act.replica, act.replica.by_id[b.config.id], act.request.hashes, now,
                             holders="kv_pool" if self.topology.record_at_decision else "both")
            if out.finished:
                record.finish_s = now
                act.ticket.finish()
                act.replica.dispatch.observe_prompt_tokens(self.model, act.request.prompt_bytes, out.prompt_tokens)
                del self._active[out.request_id]


def _next_grid_point(t0: float, interval: float, now: float) -> float:
    """The first scrape time t0 + k·interval at or after ``now``."""
    point = t0 + math.ceil((now - t0) / interval) * interval
    while point < now:
        point += interval
    return point


def simulate(fleet: Fleet, policy: Policy, requests: Sequence[PreparedRequest], *, seed: int = 0,
             observer: DecisionObserver | None = None, topology: Topology = Topology(),
             client_concurrency: int | None = None) -> SimResult:
    """Run ``requests`` through ``fleet`` under ``policy`` (see `Simulator`)."""
    return Simulator(fleet, policy, requests, seed=seed, observer=observer, topology=topology,
                     client_concurrency=client_concurrency).run()
