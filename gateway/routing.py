"""The gateway's routing: parse and hash a body, then the shared pipeline (`dispatch`).

Steps 1–2 of DESIGN.md §1 live here: the body is parsed once (orjson) and validated
minimally — enough to route and to answer bad input with a clear 400 — then canonicalised
and hashed (`prefix_index`). Steps 3–4 and the bookkeeping are `dispatch.Dispatcher`'s, the
code the simulator runs too; this module gives it the gateway's backends, telemetry and
clock. Index trouble degrades routing (no prefix match, a counter, one warning per
outage), never the request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from dispatch import Dispatcher, Plan, RoutableRequest, Ticket
from fleet_config.settings import Settings
from gateway.backends import BackendSet, BackendState
from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend
from gateway.telemetry import Telemetry
from prefix_index import (
    CanonicalizationError,
    PrefixIndex,
    PrefixIndexError,
    block_hashes,
    block_size_bytes,
    cache_salt,
    chain_seed,
    chat_canonical_bytes,
    completion_canonical_bytes,
)
from router.calibration import BytesPerToken
from router.policies import Policy
from router.profiles import GB
from router.types import Candidate

log = logging.getLogger("kappa_gateway.routing")

Kind = Literal["chat", "completion"]
# KV the gateway charges for the output of a request that sets no max_tokens (vLLM would
# fill the context; most clients stop far earlier): an estimate, named as one.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
# At most one "index unavailable" warning per this many seconds; gateway_index_errors_total counts every failure.
INDEX_WARNING_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class ParsedRequest(RoutableRequest):
    """A validated request body and what routing derived from it (model, hashes, sizes)."""

    kind: Kind
    body: dict[str, Any]
    stream: bool


RoutePlan = Plan  # the gateway's name for a dispatch plan: `plan.targets` are `BackendState`s


class RoutingService:
    """Owns the per-request routing path; built once by the lifespan.

    Args:
        settings: validated config.
        backends: backend states (health, scrape, ledger).
        index: the prefix index (memory or Redis).
        policy: the configured policy.
        telemetry: metrics.
        calibration: bytes-per-token per model.
        rng: randomness for tie-breaks (seeded from ``routing.seed`` when set).
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, settings: Settings, backends: BackendSet, index: PrefixIndex, policy: Policy,
                 telemetry: Telemetry, calibration: BytesPerToken, rng: random.Random,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self.backends = backends
        self.telemetry = telemetry
        self.clock = clock
        self.served_models = set(settings.served_models())
        self.block_bytes = block_size_bytes(settings.index.block_size_tokens, settings.index.bytes_per_token)
        kv_pool_bytes = settings.kv_pool.capacity_gb * GB if settings.kv_pool is not None else None
        self.dispatcher = Dispatcher(index, policy, rng, calibration, block_size_bytes=self.block_bytes,
                                     kv_pool_bytes=kv_pool_bytes, hooks=self, clock=clock, gather=asyncio.gather)
        self._index_degraded = False
        self._warned_at_s: float | None = None  # clock() of the last "unavailable" warning
        self._errors_since_warning = 0
        self._recovery_owed = False
        self._decision_seconds = telemetry.decision_seconds.labels(policy.name)
        self._index_seconds = {op: telemetry.index_seconds.labels(op) for op in ("match", "record", "forget")}

    # -- parsing -------------------------------------------------------------------------
    def parse(self, kind: Kind, raw: bytes) -> ParsedRequest:
        """Validate a body enough to route it.

        Raises:
            BadRequest: not JSON, not an object, missing/ill-typed model, messages or prompt,
                stream, max_tokens, n or best_of of the wrong type.
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
        sequences = _sequences(body)
        if model not in self.served_models:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        try:
            data = chat_canonical_bytes(body) if kind == "chat" else completion_canonical_bytes(body)
            seed = chain_seed(model, cache_salt(body))
        except CanonicalizationError as exc:
            raise BadRequest(str(exc), param=field) from None
        hashes = block_hashes(data, block_size_bytes=self.block_bytes, seed=seed)
        return ParsedRequest(model=model, hashes=hashes, prompt_bytes=len(data), max_tokens=max_tokens, kind=kind,
                             body=body, stream=bool(stream), sequences=sequences)

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

    # -- deciding and bookkeeping (the shared pipeline) ----------------------------------
    async def plan(self, parsed: ParsedRequest, *, dry_run: bool = False) -> RoutePlan:
        """Rank the healthy backends serving the request's model (`dispatch.Dispatcher.plan`).

        Raises:
            NoHealthyBackend: no healthy backend serves the model.
        """
        targets = self.backends.eligible(parsed.model)
        if not targets:
            raise NoHealthyBackend(f"No healthy backend is serving `{parsed.model}` right now.")
        return await self.dispatcher.plan(parsed, targets, dry_run=dry_run)

    def charge(self, plan: RoutePlan, candidate: Candidate) -> Ticket:
        """Charge a candidate to its backend's ledger now (`dispatch.Dispatcher.charge`)."""
        return self.dispatcher.charge(plan, candidate)

    async def record(self, model: str, state: BackendState, hashes: list[int]) -> None:
        """The backend (and the shared KV pool) now caches this chain: tell the index."""
        await self.dispatcher.record(model, state, hashes)

    async def forget(self, backend_id: str) -> None:
        """Drop a restarted backend's entries (the backend set's restart hook)."""
        await self.dispatcher.forget(self.backends.by_id[backend_id])

    def observe_usage(self, plan: RoutePlan, candidate: Candidate, usage: dict[str, Any]) -> None:
        """Feed a response's usage into bytes/token calibration and index-accuracy metrics."""
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int):
            return
        model = plan.request.model
        if self.dispatcher.observe_prompt_tokens(model, plan.request.prompt_bytes, prompt_tokens):
            self.telemetry.bytes_per_token.labels(model).set(self.dispatcher.calibration.get(model))
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            series = self.telemetry.backend(candidate.backend_id)
            series.cached_estimated.inc(candidate.cached_tokens)
            series.cached_reported.inc(cached)

    # -- dispatch.DispatchHooks ------------------------------------------------------------
    def decided(self, seconds: float) -> None:
        self._decision_seconds.observe(seconds)

    def index_answered(self, op: str, seconds: float) -> None:
        self._index_seconds[op].observe(seconds)
        if op == "match":
            self._recovered()

    def index_failed(self, op: str, exc: PrefixIndexError) -> None:
        self._degraded(op, exc)

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


def _sequences(body: dict[str, Any]) -> int:
    """Output sequences the request makes the backend hold: OpenAI's ``n`` (choices, default 1), or
    ``best_of`` when larger (legacy completions: that many are generated server-side and the best
    ``n`` returned, OpenAI's API reference). Each holds its own output KV (`router.cost.kv_demand_bytes`).

    Raises:
        BadRequest: ``n`` or ``best_of`` present and not a positive integer.
    """
    sequences = 1
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer.", param=key)
        sequences = max(sequences, value)
    return sequences
