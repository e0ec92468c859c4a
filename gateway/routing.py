"""From a request body to a ranked routing decision: parse, hash, look up, decide, charge.

Steps 1–4 of DESIGN.md §1. The body is parsed once (orjson) and validated minimally —
enough to route and to answer bad input with a clear 400 — then canonicalised and hashed
(`prefix_index`), matched against every eligible backend in one index call, turned into
`router.types.BackendView` snapshots and ranked by the configured policy
(`router.decide`). Index trouble degrades routing (no prefix match, a counter, one warning
per outage), never the request.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend
from gateway.pool import BackendPool, BackendState, Ticket
from gateway.settings import Settings
from gateway.telemetry import Telemetry
from prefix_index import (
    BlockMatch,
    CanonicalizationError,
    POOL_ID,
    PendingChains,
    PrefixIndex,
    PrefixIndexError,
    TierCapacity,
    block_hashes,
    block_size_bytes,
    cache_salt,
    chain_seed,
    chat_canonical_bytes,
    completion_canonical_bytes,
    pool_capacity,
    with_pool,
)
from router import kappa
from router.profiles import GB
from router.calibration import BytesPerToken
from router.decide import decide
from router.policies import Policy
from router.types import BackendView, Candidate, Decision, RequestFeatures

log = logging.getLogger("kappa_gateway.routing")

Kind = Literal["chat", "completion"]
# KV the gateway charges for the output of a request that sets no max_tokens (vLLM would
# fill the context; most clients stop far earlier): an estimate, named as one.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
# At most one "index unavailable" warning per this many seconds; gateway_index_errors_total counts every failure.
INDEX_WARNING_INTERVAL_S = 60.0
_NO_MATCH = BlockMatch(0, 0, 0)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request body and what routing derived from it."""

    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int
    prompt_bytes: int
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A decision plus what the relay needs to charge and report it."""

    request: ParsedRequest
    features: RequestFeatures
    decision: Decision
    states: dict[str, BackendState]
    index_ok: bool


class RoutingService:
    """Owns the per-request routing path; built once by the lifespan.

    Args:
        settings: validated config.
        pool: backend states and the ledger.
        index: the prefix index (memory or Redis).
        policy: the configured policy.
        telemetry: metrics.
        calibration: bytes-per-token per model.
        rng: randomness for tie-breaks (seeded from ``routing.seed`` when set).
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, settings: Settings, pool: BackendPool, index: PrefixIndex, policy: Policy,
                 telemetry: Telemetry, calibration: BytesPerToken, rng: random.Random,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self.pool = pool
        self.index = index
        self.policy = policy
        self.telemetry = telemetry
        self.calibration = calibration
        self.rng = rng
        self.clock = clock
        self.block_bytes = block_size_bytes(settings.index.block_size_tokens, settings.index.bytes_per_token)
        self.served_models = set(settings.served_models())
        self.pending = PendingChains()  # chains of the requests in flight, by backend
        # A KV store the fleet shares (config kv_pool): its chains live in the index under POOL_ID.
        self.pool_bytes = settings.kv_pool.capacity_gb * GB if settings.kv_pool is not None else None
        self._index_degraded = False
        self._warned_at_s: float | None = None  # clock() of the last "unavailable" warning
        self._errors_since_warning = 0
        self._recovery_owed = False
        self._capacities: dict[tuple[str, str], tuple[tuple[float, float], TierCapacity]] = {}
        self._decision_seconds = telemetry.decision_seconds.labels(policy.name)
        self._match_seconds = telemetry.index_seconds.labels("match")
        self._record_seconds = telemetry.index_seconds.labels("record")

    # -- parsing -------------------------------------------------------------------------
    def parse(self, kind: Kind, raw: bytes) -> ParsedRequest:
        """Validate a body enough to route it.

        Raises:
            BadRequest: not JSON, not an object, missing/ill-typed model, messages or prompt,
                stream or max_tokens of the wrong type.
            ModelNotFound: no backend serves the model.
        """
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required and must be a non-empty string.", param="model")
        field = "messages" if kind == "chat" else "prompt"
        if field not in body or body[field] is None:
            raise BadRequest(f"'{field}' is required.", param=field)
        if kind == "chat" and (not isinstance(body["messages"], list) or not body["messages"]):
            raise BadRequest("'messages' must be a non-empty array.", param="messages")
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise BadRequest("'stream' must be a boolean.", param="stream")
        max_tokens = self._max_tokens(body, kind)
        if model not in self.served_models:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        try:
            data = chat_canonical_bytes(body) if kind == "chat" else completion_canonical_bytes(body)
            seed = chain_seed(model, cache_salt(body))
        except CanonicalizationError as exc:
            raise BadRequest(str(exc), param=field) from None
        hashes = block_hashes(data, block_size_bytes=self.block_bytes, seed=seed)
        return ParsedRequest(kind, body, model, bool(stream), max_tokens, len(data), hashes)

    @staticmethod
    def _max_tokens(body: dict[str, Any], kind: Kind) -> int:
        keys = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
        for key in keys:
            value = body.get(key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadRequest(f"'{key}' must be a positive integer.", param=key)
            return value
        return DEFAULT_MAX_TOKENS_ESTIMATE

    # -- deciding ------------------------------------------------------------------------
    def capacity(self, state: BackendState, model: str) -> TierCapacity:
        """A backend's KV capacity in index blocks, HBM and host tier (recomputed only when
        the scraped capacity or the bytes/token calibration moved)."""
        inputs = (state.kv_capacity_bytes, self.calibration.get(model))
        cached = self._capacities.get((state.id, model))
        if cached is not None and cached[0] == inputs:
            return cached[1]
        block_kv_bytes = self.tokens_per_block(model) * kappa.b_kv_bytes(state.spec.model)
        capacity = TierCapacity(int(state.kv_capacity_bytes // block_kv_bytes),
                                int(state.host_tier_bytes // block_kv_bytes))
        self._capacities[(state.id, model)] = (inputs, capacity)
        return capacity

    def pool_capacity(self, state: BackendState, model: str) -> TierCapacity | None:
        """The shared KV pool's capacity in index blocks of ``model`` (None without a pool);
        ``state`` is any backend serving it (for B_kv)."""
        if self.pool_bytes is None:
            return None
        return pool_capacity(self.pool_bytes, self.tokens_per_block(model) * kappa.b_kv_bytes(state.spec.model))

    def tokens_per_block(self, model: str) -> float:
        return self.block_bytes / self.calibration.get(model)

    async def plan(self, parsed: ParsedRequest, *, dry_run: bool = False) -> RoutePlan:
        """Rank the eligible backends for a parsed request.

        ``dry_run`` (the explain endpoint) decides on copies of the policy and the random
        generator, so explaining a request leaves the next real decision as it would have
        been (round-robin's turn, tie-breaks), and is not timed in the decision histogram.

        Raises:
            NoHealthyBackend: no healthy backend serves the model.
        """
        states = self.pool.eligible(parsed.model)
        if not states:
            raise NoHealthyBackend(f"No healthy backend is serving `{parsed.model}` right now.")
        capacities = {s.id: self.capacity(s, parsed.model) for s in states}
        pool = self.pool_capacity(states[0], parsed.model)
        lookup = capacities if pool is None else {**capacities, POOL_ID: pool}
        matches, index_ok = await self._match(parsed, lookup)
        matches = self.pending.overlay(parsed.model, parsed.hashes, matches, lookup)
        if pool is not None:
            matches = with_pool(matches, capacities)
        tokens_per_block = self.tokens_per_block(parsed.model)
        features = RequestFeatures(
            model=parsed.model,
            prompt_tokens=max(round(parsed.prompt_bytes / self.calibration.get(parsed.model)), 1),
            max_tokens=parsed.max_tokens,
            prompt_blocks=len(parsed.hashes),
            block_size_tokens=tokens_per_block,
        )
        views = [self._view(s, matches.get(s.id, _NO_MATCH), capacities[s.id]) for s in states]
        if dry_run:
            rng = random.Random()
            rng.setstate(self.rng.getstate())
            decision = decide(copy.deepcopy(self.policy), features, views, rng)
        else:
            start = self.clock()
            decision = decide(self.policy, features, views, self.rng)
            self._decision_seconds.observe(self.clock() - start)
        return RoutePlan(parsed, features, decision, {s.id: s for s in states}, index_ok)

    async def _match(self, parsed: ParsedRequest, capacities: dict[str, TierCapacity]) -> tuple[dict[str, BlockMatch], bool]:
        if not parsed.hashes:
            return {}, True
        start = self.clock()
        try:
            matches = await self.index.match(parsed.model, parsed.hashes, capacities)
        except PrefixIndexError as exc:
            self._degraded("match", exc)
            return {}, False
        self._match_seconds.observe(self.clock() - start)
        self._recovered()
        return matches, True

    @staticmethod
    def _view(state: BackendState, match: BlockMatch, capacity: TierCapacity) -> BackendView:
        m = state.metrics
        return BackendView(
            backend_id=state.id, spec=state.spec,
            matched_blocks=match.matched_blocks, hbm_blocks=match.hbm_blocks, host_blocks=match.host_blocks,
            pool_blocks=match.pool_blocks, in_flight_blocks=match.in_flight_blocks,
            cached_blocks=min(state.recorded_blocks, capacity.total_blocks),
            in_flight=state.in_flight, kv_demand_bytes=state.kv_demand_bytes,
            outstanding_prefill_s=state.outstanding_prefill_s, kv_capacity_bytes=state.kv_capacity_bytes,
            num_requests_waiting=m.num_requests_waiting, num_requests_running=m.num_requests_running,
            kv_cache_usage_ratio=m.kv_cache_usage_ratio,
        )

    # -- accounting ----------------------------------------------------------------------
    def charge(self, plan: RoutePlan, candidate: Candidate) -> Ticket:
        """Charge a candidate's KV demand and prefill to its backend's ledger, now, and mark
        its chain as in flight there (`prefix_index.pending`) until the request ends: its
        prefill computes the chain into that backend's HBM, and vLLM does not evict the
        blocks of a running request."""
        state = plan.states[candidate.backend_id]
        est = candidate.estimate
        model, hashes = plan.request.model, plan.request.hashes
        self.pending.add(model, state.id, hashes)
        return Ticket(state, est.kv_demand_bytes, est.prefill_s,
                      on_finish=lambda: self.pending.remove(model, state.id, hashes))

    async def record(self, model: str, state: BackendState, hashes: list[int]) -> None:
        """The backend now caches this chain (its prefill ran), and so does the shared KV pool
        if there is one (the backend writes through to it): tell the index."""
        if not hashes:
            return
        start = self.clock()
        pool = self.pool_capacity(state, model)
        try:
            if pool is None:
                await self.index.record(model, state.id, hashes, self.capacity(state, model))
            else:  # both in the same event-loop turn: one batched index call
                await asyncio.gather(self.index.record(model, state.id, hashes, self.capacity(state, model)),
                                     self.index.record(model, POOL_ID, hashes, pool))
        except PrefixIndexError as exc:
            self._degraded("record", exc)
            return
        state.recorded_blocks += len(hashes)
        self._record_seconds.observe(self.clock() - start)

    async def forget(self, backend_id: str) -> None:
        """Drop a restarted backend's entries (the pool's restart hook)."""
        try:
            await self.index.forget(backend_id)
        except PrefixIndexError as exc:
            self._degraded("forget", exc)
            return
        self.pool.by_id[backend_id].recorded_blocks = 0

    def observe_usage(self, plan: RoutePlan, candidate: Candidate, usage: dict[str, Any]) -> None:
        """Feed a response's usage into bytes/token calibration and index-accuracy metrics."""
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int):
            return
        if self.calibration.observe(plan.request.model, plan.request.prompt_bytes, prompt_tokens):
            self.telemetry.bytes_per_token.labels(plan.request.model).set(self.calibration.get(plan.request.model))
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            series = self.telemetry.backend(candidate.backend_id)
            series.cached_estimated.inc(candidate.cached_tokens)
            series.cached_reported.inc(cached)

    def _degraded(self, op: str, exc: Exception) -> None:
        """Count an index failure; warn at the start of an outage, at most once per
        ``INDEX_WARNING_INTERVAL_S`` (an overloaded Redis fails and answers by turns, and
        each turn must not cost two log lines)."""
        self.telemetry.index_errors.labels(op).inc()
        self._errors_since_warning += 1
        if self._index_degraded:
            return
        self._index_degraded = True
        now = self.clock()
        if self._warned_at_s is None or now - self._warned_at_s >= INDEX_WARNING_INTERVAL_S:
            extra = "" if self._errors_since_warning == 1 else f"; {self._errors_since_warning} index errors since the last warning"
            log.warning("prefix index unavailable (%s: %s): routing without prefix matches until it recovers%s",
                        op, exc, extra)
            self._warned_at_s = now
            self._errors_since_warning = 0
            self._recovery_owed = True

    def _recovered(self) -> None:
        if self._index_degraded:
            self._index_degraded = False
            if self._recovery_owed:  # only a warned outage gets its recovery line
                self._recovery_owed = False
                log.warning("prefix index reachable again: prefix-aware routing resumed")
