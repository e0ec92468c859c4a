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

On a P/D fleet (`sim.fleet.Fleet.pd_fleet`) the router also gets roles and links
(`dispatch.Dispatcher.pd`), and a split decision runs as `sim.pd` describes: prefill on one
engine, the KV pull over the link, decode on another.

Events, in virtual seconds: arrivals (from the trace), engine step ends, scrapes, pulls. An engine
runs its steps back to back while it has work: the next step starts when the previous one
ends; an idle engine starts one at the arrival time. At one instant, events go in this
order: scrapes due strictly before it, step ends (their outputs: first tokens, finishes),
a scrape due at it, pulls done (their decodes join the decode engines), arrivals (in trace order), then every idle engine with work starts a
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
from router.link_factors import MeasurementSettings
from sim.fleet import Fleet, SimBackend
from sim.measure import PrefillClock, Sent, measured_figures
from sim.pd import SplitRunner
from sim.prompts import PreparedRequest, token_ids
from sim.records import DecisionEvent, DecisionObserver, RequestRecord, SimResult, run_now
from sim.replicas import Replica, Spreader, Topology, build_replicas, sync_peers

__all__ = ["DecisionEvent", "DecisionObserver", "RequestRecord", "SimResult", "Simulator", "run_now", "simulate"]

class _Engine:
    """One backend's engine (its truth's, `sim.fleet.SimBackend.engine_spec`), its step in progress,
    when it got its first request and, when measuring, its prefill-time histogram."""

    __slots__ = ("engine", "config", "step", "first_add_s", "prefill_clock")

    def __init__(self, config: SimBackend, kv_pool: SharedKVPool | None = None, *, measure: bool = False) -> None:
        self.engine = MockEngine(config.engine_spec, config.engine_config, kv_pool)
        self.config = config
        self.step: StepResult | None = None
        self.first_add_s: float | None = None
        self.prefill_clock = PrefillClock() if measure else None


class _Backend(Target):
    """What one gateway replica knows of one engine (a `dispatch.Target`)."""

    def __init__(self, engine: _Engine, measurement: MeasurementSettings) -> None:
        config, stats = engine.config, engine.engine.stats
        super().__init__(config.id, config.spec, host_tier_bytes=config.host_tier_bytes,
                         num_gpu_blocks_override=config.engine.num_gpu_blocks_override,
                         metrics=BackendMetrics(block_size_tokens=engine.engine.block_size,
                                                num_gpu_blocks=stats.num_gpu_blocks), measurement=measurement)
        self.source = engine

    def scrape(self, now: float) -> None:
        """What a scrape of vLLM's /metrics would read now; when measuring, the fit's interval closes."""
        stats, clock = self.source.engine.stats, self.source.prefill_clock
        metrics = replace(self.metrics, num_requests_waiting=stats.num_requests_waiting,
                          num_requests_running=stats.num_requests_running,
                          kv_cache_usage_ratio=stats.kv_cache_usage_ratio)
        if clock is not None:
            metrics = replace(metrics, prefill_time_count=clock.count, prefill_time_sum_s=clock.sum_s,
                              kv_loaded_tokens_total=float(stats.prompt_tokens_by_source["external_kv_transfer"]))
        self.scraped(metrics)
        if clock is not None:
            self.measure(metrics, now)


class _Active:
    """A request between decision and finish: its record, its ticket, what calibration needs,
    and the replica that routed it (which records its chain and calibrates from it)."""

    __slots__ = ("record", "ticket", "request", "replica", "sent")

    def __init__(self, record: RequestRecord, ticket: Ticket, request: RoutableRequest, replica: Replica,
                 sent: Sent | None = None) -> None:
        self.record, self.ticket, self.request, self.replica = record, ticket, request, replica
        self.sent = sent  # followed for the fit (measuring, not split)


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
        self._measuring = fleet.measurement.enabled
        self._engines = [_Engine(b, self._kv_pool, measure=self._measuring) for b in served]
        self._position = {e.config.id: i for i, e in enumerate(self._engines)}
        self.topology = topology
        self._replicas = build_replicas(topology, MemoryPrefixIndex(), policy, seed,
                                        make_targets=lambda: [_Backend(e, fleet.measurement) for e in self._engines],
                                        bytes_per_token=fleet.bytes_per_token,
                                        block_size_bytes=fleet.block_size_bytes, kv_pool_bytes=fleet.kv_pool_bytes)
        self._targets = [t for r in self._replicas for t in r.targets]  # every view, scraped together
        pd = fleet.pd_fleet()
        for replica in self._replicas:
            replica.dispatch.pd = pd
        self._splits = SplitRunner(fleet, lambda backend_id: self._engines[self._position[backend_id]].engine,
                                   self._record_computed)
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
        self._scrape_all(t0)
        next_scrape = t0 + interval
        steps: list[tuple[float, int]] = []  # (end_s, backend position): at most one per backend
        held: deque[PreparedRequest] = deque()  # arrived, waiting client-side for a free slot
        cap = self.client_concurrency
        i = 0
        splits = self._splits
        while i < n or steps or held or splits.busy:
            now = steps[0][0] if steps else math.inf
            if i < n and reqs[i].arrival_s < now:
                now = reqs[i].arrival_s
            pull_s = splits.next_pull_s
            if pull_s is not None and pull_s < now:
                now = pull_s
            if next_scrape < now:  # nothing happened since that scrape time: the state is as it was
                self._scrape_all(next_scrape)
                next_scrape = _next_grid_point(t0, interval, now)
            kick: list[int] = []
            while steps and steps[0][0] == now:
                _, pos = heapq.heappop(steps)
                self._step_end(self._engines[pos], now)
                kick.append(pos)
            if next_scrape == now:
                self._scrape_all(now)
                next_scrape += interval
            self._apply_records(now)
            if pull_s == now:
                for backend_id in splits.pulls_due(now):
                    engine = self._engines[self._position[backend_id]]
                    kick.append(self._position[backend_id])
                    if engine.first_add_s is None:
                        engine.first_add_s = now
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
        return self._result(t0, started)

    def _result(self, t0: float, started: float) -> SimResult:
        """The run's result (energy: every backend powered from the first arrival to the last finish)."""
        end = max((r.finish_s for r in self._records.values() if r.finish_s is not None), default=t0)
        energy = {}
        for b in self._engines:
            idle_before = b.config.engine_spec.idle_power_w * ((b.first_add_s if b.first_add_s is not None else end) - t0)
            energy[b.config.id] = b.engine.energy_j(end) + idle_before
        records = [self._records[k] for k in sorted(self._records)]
        return SimResult(self.policy.name, records, self._rejected, t0, end, energy,
                         tuple(b.config for b in self._engines), time.perf_counter() - started,
                         measured_figures(self._replicas[0].targets) if self._measuring else {})

    def _scrape_all(self, now: float) -> None:
        for target in self._targets:
            target.scrape(now)  # type: ignore[attr-defined]  # every target here is a _Backend

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
        cand, leg = plan.decision.chosen, plan.decision.prefill
        first = cand if leg is None else leg.candidate  # the engine that gets the request now
        b = self._engines[self._position[first.backend_id]]
        rid = str(req.index)
        est = first.estimate
        record = RequestRecord(req.index, now, cand.backend_id, req.max_tokens, est.kappa_ratio, est.kappa_ratio_loaded,
                               est.kappa_crit, est.regime.value, est.ttft_s)
        try:
            if leg is None:
                b.engine.add_request(rid, token_ids(req), max_tokens=req.max_tokens, arrival_s=now)
                ticket = replica.dispatch.charge(plan, cand)
            else:
                prefill_ticket, ticket = replica.dispatch.charge_split(plan)
                try:
                    self._splits.start(rid, leg, cand.backend_id, record, prefill_ticket, replica, request,
                                       token_ids(req), req.max_tokens, now)
                except PromptTooLong:
                    prefill_ticket.finish()
                    ticket.finish()
                    raise
        except PromptTooLong:  # a 400 from the backend: the gateway relays it, retries only 5xx
            self._rejected.append(req.index)
            return None
        self._records[req.index] = record
        sent = Sent(replica.by_id[cand.backend_id], cand, now) if self._measuring and leg is None else None
        self._active[rid] = _Active(record, ticket, request, replica, sent)
        if self.topology.record_at_decision:
            for backend_id in {cand.backend_id, first.backend_id}:
                self._record(replica, replica.by_id[backend_id], request.hashes, now, holders="backend")
        if b.first_add_s is None:
            b.first_add_s = now
        return self._position[first.backend_id]

    def _record_computed(self, replica: Replica, backend_id: str, request: RoutableRequest, now: float) -> None:
        """A split's prefill backend computed the prompt (its token came back): record it."""
        self._record(replica, replica.by_id[backend_id], request.hashes, now,
                     holders="kv_pool" if self.topology.record_at_decision else "both")

    # -- engine outputs (the gateway's relay: first byte, record, finish, usage) ------------
    def _step_end(self, b: _Engine, now: float) -> None:
        step, b.step = b.step, None
        assert step is not None
        for out in step.outputs:
            if b.prefill_clock is not None:
                b.prefill_clock.output(out, now)
            act = self._active.get(out.request_id)
            if act is None:  # a split's prefill half (`sim.pd`)
                self._splits.prefill_done(out, now)
                continue
            record = act.record
            if record.first_token_s is None:
                record.first_token_s = now
                if record.prefill_backend_id is None:  # a split's are its prefill's (`sim.pd`)
                    record.prompt_tokens, record.cached_tokens = out.prompt_tokens, out.cached_tokens
                    record.cached_host_tokens = out.cached_host_tokens
                    record.cached_kv_pool_tokens = out.cached_kv_pool_tokens
                act.ticket.first_byte()
                if act.sent is not None:
                    act.sent.first_token(now)
                self._record(act.replica, act.replica.by_id[b.config.id], act.request.hashes, now,
                             holders="kv_pool" if self.topology.record_at_decision else "both")
            if out.finished:
                record.finish_s = now
                act.ticket.finish()
                if act.sent is not None:
                    act.sent.finished(out, now)
                elif self._measuring:  # a split: no prediction, its interval is not attributed (as live)
                    act.replica.by_id[b.config.id].figures.feed.completed_request(-1, None, now)
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
