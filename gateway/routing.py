"""The gateway's routing: parse and hash a body, then the shared pipeline (`dispatch`).

Steps 1–2 of DESIGN.md §1 live here: the body is parsed once (orjson) and validated
minimally — enough to route and to answer bad input with a clear 400 — then canonicalised
and hashed (`prefix_index`). Steps 3–4 and the bookkeeping are `dispatch.Dispatcher`'s, the
code the simulator runs too; this module gives it the gateway's backends, telemetry and
clock. Index trouble degrades routing (no prefix match, a counter, one warning per
outage), never the request.

What is refused and what is relayed: a body that is not a JSON object orjson accepts
(RFC 8259, nesting ≤ 1,024, numbers within a double, no lone surrogates, no NaN; a
leading UTF-8 BOM is ignored, as RFC 8259 §8.1 allows and Python's json, vLLM's parser,
does), or whose ``model``, ``messages``/``prompt``, ``stream``, ``max_tokens`` or
``cache_salt`` is missing or ill-typed, or whose messages or prompt have a shape no OpenAI
server takes (a role that is not a string, a part that is not an object, a token id that
is not an int, ...), gets a 400: vLLM would refuse it too. A well-formed body the canonicaliser cannot represent
(`prefix_index.NestingTooDeep`: ``tools``, ``chat_template_kwargs``, ``tool_calls`` or a
media part nested ~1,000 levels deep) is not the client's error and may be what the
backend accepts, so it is relayed with load-only routing — no prefix hashes, the body's
length standing in for its prompt's, no bytes-per-token sample — and counted in
``gateway_load_only_requests_total{reason}``: a trusted proxy does not refuse what its
upstream might take.

A chat body's canonical bytes are also kept, in a `gateway.invalidation.PendingFinding`, until
`RoutingService.invalidation` holds its message fingerprint against the conversations seen before
(`gateway.invalidation`): the proxy runs it once the request is on its way upstream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from dispatch import BackendMetrics, Dispatcher, Plan, Ticket
from fleet_config.settings import Settings
from gateway.backends.backend_set import BackendSet
from gateway.backends.backend_state import BackendState
from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend, excerpt
from gateway.backends.index_truth import IndexTruth
from gateway.backends.engine_tokens import INLINE_MAX_BYTES
from gateway.backends.kv_events_fleet import KvEventsFleet, TokenIdsOf, engine_chain_of, request_token_ids
from gateway.backends.pd_links import PdLinks
from gateway.telemetry.metrics import Telemetry
from gateway.telemetry.outage import OutageLog
from gateway.invalidation import LiveInvalidation, PendingFinding
from gateway.parsed import (  # noqa: F401  (DEFAULT_MAX_TOKENS_ESTIMATE: re-exported)
    DEFAULT_MAX_TOKENS_ESTIMATE, Kind, ParsedRequest, load_body, max_tokens_of, sequences_of)
from prefix_index import (
    CanonicalizationError,
    Finding,
    IndexCircuitOpen,
    NestingTooDeep,
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
from router.link_factors import MeasurementSettings, measured_link
from router.links import Interconnect, Link
from router.policies import Policy
from router.profiles import GB
from router.types import Candidate, PdFleet

log = logging.getLogger("kappa_gateway.routing")

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
        self.pd_links: PdLinks | None = None
        self._pd_priced: dict[tuple[str, str], Link] = {}  # P/D links priced at measured figures
        if settings.disaggregated:  # P/D: roles and links; the links' check keeps the unusable set
            self._setup_pd(settings)
        self.index_truth = IndexTruth(self.dispatcher, backends, telemetry, clock, kv_pool=kv_pool_bytes is not None)
        # Issue 30: the KV-event subscribers and exact index (set by the lifespan), and the engines'
        # tokenizer (None: only token-id prompts route exactly; `request_token_ids`).
        self.kv_events: KvEventsFleet | None = None
        self.tokenize: TokenIdsOf | None = None
        # The index's outages: one "unavailable" line, one "reachable again" (gateway_index_errors_total
        # counts every failure).
        self._index_outage = OutageLog(
            log, unavailable="prefix index unavailable ({detail}): routing without prefix matches until it recovers",
            recovered="prefix index reachable again: prefix-aware routing resumed", clock=clock,
            errors_noun="index errors")
        self._decision_seconds = telemetry.decision_seconds.labels(policy.name)
        self._load_only = {NestingTooDeep.reason: telemetry.load_only_requests.labels(NestingTooDeep.reason)}
        self._index_seconds = {op: telemetry.index_seconds.labels(op) for op in ("match", "record", "forget")}
        self.live_invalidation = LiveInvalidation(telemetry, self.served_models)

    def _setup_pd(self, settings: Settings) -> None:
        roles = {b.id: b.kv_role for b in settings.backends}
        table = settings.interconnect_table()
        pd = self.dispatcher.pd = PdFleet(roles, table)
        pairs = [(p.id, d.id) for p in settings.backends for d in settings.backends
                 if p.id != d.id and p.model == d.model and roles[p.id] != "decode" and roles[d.id] != "prefill"]

        def unusable(pairs: frozenset[tuple[str, str]]) -> None:
            self.dispatcher.pd = PdFleet(pd.roles, self.dispatcher.pd.interconnect, pairs)  # type: ignore[union-attr]

        section = settings.interconnect
        assert section is not None  # disaggregated
        links = self.pd_links = PdLinks(pairs, table, self.telemetry.pd, self.clock, unusable,
                                        {b.id: b.tensor_parallel for b in settings.backends},
                                        section.degraded_ratio, section.probe_interval_s)
        measurement = settings.routing.measured_figures.settings()

        def scraped(state: BackendState, previous: BackendMetrics, current: BackendMetrics) -> None:
            links.scraped(state.id, previous, current)
            self._price_pd_links(table, measurement)

        self.backends.on_scraped = scraped

    def _price_pd_links(self, table: Interconnect, measurement: MeasurementSettings) -> None:
        """Price each P/D link at its measured bandwidth blended with its configured one, by its transfers
        (`router.link_factors.measured_link`); the dispatcher's links change only when a blend moves."""
        pd, links = self.dispatcher.pd, self.pd_links
        assert pd is not None and links is not None
        measured = {k: measured_link(r.configured, r.delivered_bytes_per_s, r.transfers, measurement)
                    for k, r in links.links.items()}
        priced = {k: link for k, link in measured.items() if link is not links.links[k].configured}
        if priced != self._pd_priced:
            self._pd_priced = priced
            self.dispatcher.pd = PdFleet(pd.roles, replace(table, pairs={**table.pairs, **priced}), pd.unusable)

    # -- parsing -------------------------------------------------------------------------
    def parse(self, kind: Kind, raw: bytes) -> ParsedRequest:
        """Validate a body enough to route it: `load_body`, then `parse_loaded`.

        Raises:
            BadRequest: not JSON; as `parse_loaded`.
            ModelNotFound: as `parse_loaded`.
        """
        return self.parse_loaded(kind, load_body(raw), len(raw))

    def parse_loaded(self, kind: Kind, body: Any, raw_bytes: int) -> ParsedRequest:
        """Validate a body already loaded by `load_body` enough to route it.

        Args:
            kind: the route's kind.
            body: the body's JSON value.
            raw_bytes: the raw body's size in bytes (the prompt size of a load-only request).

        Returns:
            The parsed request; for a body too deeply nested to canonicalise, one with no
            hashes and ``load_only_reason`` set (module docstring).

        Raises:
            BadRequest: not an object, missing/ill-typed model, messages or prompt, stream,
                max_tokens, n, best_of or cache_salt of the wrong type.
            ModelNotFound: no backend serves the model.
        """
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
        max_tokens = max_tokens_of(body, kind)
        sequences = sequences_of(body)
        if model not in self.served_models:
            raise ModelNotFound(f"The model `{excerpt(model)}` does not exist.", param="model")
        try:
            seed = chain_seed(model, cache_salt(body))
        except CanonicalizationError as exc:
            raise BadRequest(str(exc), param="cache_salt") from None
        try:
            data = chat_canonical_bytes(body) if kind == "chat" else completion_canonical_bytes(body)
        except NestingTooDeep as exc:  # well-formed, beyond the canonicaliser: relayed on load alone
            return ParsedRequest(model=model, hashes=[], prompt_bytes=raw_bytes, max_tokens=max_tokens, kind=kind,
                                 stream=bool(stream), sequences=sequences, load_only_reason=exc.reason,
                                 splittable=sequences == 1 and body.get("kv_transfer_params") is None,
                                 client_kv_transfer=body.get("kv_transfer_params") is not None)
        except CanonicalizationError as exc:
            raise BadRequest(str(exc), param=field) from None
        hashes = block_hashes(data, block_size_bytes=self.block_bytes, seed=seed)
        ids, deferred = None, None
        if self.kv_events is not None and self.kv_events.any_exact(model):
            if len(data) <= INLINE_MAX_BYTES or self.tokenize is None:
                ids = request_token_ids(model, body, kind == "chat", self.tokenize)
            else:  # a long prompt: encoded off the event loop, in `plan` (gateway.backends.engine_tokens)
                deferred = body
        return ParsedRequest(tokenize_body=deferred, model=model, hashes=hashes, prompt_bytes=len(data), max_tokens=max_tokens, kind=kind,
                             stream=bool(stream), sequences=sequences, token_ids=ids, cache_salt=cache_salt(body),
                             prompt_tokens=None if ids is None else len(ids),
                             invalidation=PendingFinding(data, seed) if kind == "chat" else None,
                             splittable=sequences == 1 and body.get("kv_transfer_params") is None,
                             client_kv_transfer=body.get("kv_transfer_params") is not None)

    # -- deciding and bookkeeping (the shared pipeline) ----------------------------------
    async def plan(self, parsed: ParsedRequest, *, dry_run: bool = False) -> RoutePlan:
        """Rank the healthy backends serving the request's model (`dispatch.Dispatcher.plan`).

        A load-only request (``parsed.load_only_reason``) is counted in
        ``gateway_load_only_requests_total`` unless ``dry_run``. A long prompt whose token ids the
        exact index wants (``parsed.tokenize_body``) is encoded here, in a worker thread; the plan's
        ``request`` is then ``parsed`` with its ``token_ids``.

        Raises:
            NoHealthyBackend: no healthy backend serves the model (the gateway's one 503 for
                it: checked here, so the router's `NoEligibleBackend` for no targets never
                reaches the edge).
        """
        targets = self.backends.eligible(parsed.model)
        if not targets:
            raise NoHealthyBackend(f"No healthy backend is serving `{parsed.model}` right now.")
        if parsed.load_only_reason is not None and not dry_run:
            self._load_only[parsed.load_only_reason].inc()
        if parsed.tokenize_body is not None:  # a long prompt's token ids, encoded off the event loop
            ids = await asyncio.to_thread(request_token_ids, parsed.model, parsed.tokenize_body, parsed.kind == "chat",
                                          self.tokenize)
            parsed = dataclasses.replace(parsed, token_ids=ids, prompt_tokens=None if ids is None else len(ids),
                                         tokenize_body=None)
        exact = None
        if parsed.token_ids is not None and self.kv_events is not None:  # the exact index, for backends in sync
            exact = await self.kv_events.exact_matches(parsed.model, parsed.token_ids, [t.id for t in targets],
                                                       cache_salt=parsed.cache_salt)
            if exact:  # its engine chain, for in-flight and pool credit in the engines' blocks (dispatch.exact)
                chain, size = engine_chain_of(parsed.model, parsed.token_ids, exact, parsed.cache_salt,
                                              {t.id: t.metrics.block_size_tokens for t in targets})
                parsed = dataclasses.replace(parsed, engine_hashes=chain, engine_block_tokens=size)
        return await self.dispatcher.plan(parsed, targets, dry_run=dry_run, split=parsed.splittable, exact=exact)

    def invalidation(self, parsed: ParsedRequest, *, dry_run: bool = False) -> Finding | None:
        """The request's prefix-invalidation finding at the model's calibrated bytes/token, counted
        once unless ``dry_run`` (`gateway.invalidation.LiveInvalidation.finding`); None for a body
        without one (completions, load-only)."""
        if parsed.invalidation is None:
            return None
        return self.live_invalidation.finding(parsed.invalidation, parsed.model,
                                              self.dispatcher.calibration.get(parsed.model), dry_run=dry_run)

    def charge(self, plan: RoutePlan, candidate: Candidate) -> Ticket:
        """Charge a candidate to its backend's ledger now (`dispatch.Dispatcher.charge`)."""
        return self.dispatcher.charge(plan, candidate)

    async def record(self, model: str, state: BackendState, hashes: list[int], *,
                     holders: Literal["both", "backend", "kv_pool"] = "both", engine_hashes: Sequence[int] = (),
                     engine_block_tokens: int = 0) -> None:
        """The backend (and the shared KV pool) now caches this chain: tell the index
        (`dispatch.Dispatcher.record`; ``holders`` and the engine chain as there)."""
        await self.dispatcher.record(model, state, hashes, holders=holders, engine_hashes=engine_hashes,
                                     engine_block_tokens=engine_block_tokens)

    async def forget(self, backend_id: str) -> None:
        """Drop a restarted backend's entries, and the pool's if the whole fleet restarted (the
        backend set's restart hook; `gateway.backends.index_truth.IndexTruth.restarted`)."""
        await self.index_truth.restarted(backend_id)

    async def forget_stale(self, holders: tuple[str, ...], plan: RoutePlan, state: BackendState) -> None:
        """Drop the holders `observe_usage` found stale, then re-record the plan's chain on ``state``."""
        await self.index_truth.forget_stale(holders, plan, state)

    def observe_usage(self, plan: RoutePlan, candidate: Candidate, usage: dict[str, Any], *,
                      evidence: bool = True) -> tuple[str, ...]:
        """Feed a response's usage into bytes/token calibration and index-accuracy metrics.

        ``evidence`` False (a split request's decode phase, whose ``cached_tokens`` counts the KV it
        pulled as cached, as vLLM's scheduler does): calibration only, no check of the index's credit.

        Returns:
            The index holders (backend ids, ``KV_POOL_ID``) whose credit answers now contradict
            persistently (`dispatch.evidence`): the caller runs `forget_stale` off the request path.
        """
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int):
            return ()
        model, request = plan.request.model, plan.request
        hashed = not isinstance(request, ParsedRequest) or request.load_only_reason is None
        if hashed and self.dispatcher.observe_prompt_tokens(model, request.prompt_bytes, prompt_tokens):
            self.telemetry.bytes_per_token.labels(model).set(self.dispatcher.calibration.get(model))
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and evidence:
            series = self.telemetry.backend(candidate.backend_id)
            series.cached_estimated.inc(candidate.cached_tokens)
            series.cached_reported.inc(cached)
            return self.index_truth.observe(plan, candidate, cached)
        return ()

    # -- dispatch.DispatchHooks ------------------------------------------------------------
    def decided(self, seconds: float) -> None:
        self._decision_seconds.observe(seconds)

    def index_answered(self, op: str, seconds: float) -> None:
        self._index_seconds[op].observe(seconds)
        if op == "match":
            self._index_outage.answered()

    def index_failed(self, op: str, exc: PrefixIndexError) -> None:
        if isinstance(exc, IndexCircuitOpen):  # not sent: the breaker is open (its outage was counted and warned)
            self.telemetry.index_skipped.labels(op).inc()
            return
        self._degraded(op, exc)

    def _degraded(self, op: str, exc: Exception) -> None:
        """Count an index failure; warn when an outage starts (`gateway.telemetry.outage.OutageLog`)."""
        self.telemetry.index_errors.labels(op).inc()
        self._index_outage.failed(f"{op}: {exc}")
