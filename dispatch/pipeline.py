"""The one routing pipeline: from a hashed request to a ranked decision and its bookkeeping.

DESIGN.md §1 steps 3–4 and 6, shared by the live gateway (`gateway.routing`) and the
simulator (`sim.simulator`), so both route by the same code:

1. capacities: each target's KV capacity (`Target.kv_capacity_bytes`) and host tier in
   index blocks of the model's current tokens-per-block estimate, plus the fleet-shared KV
   pool's, if any;
2. one index call for every target and the pool (`PrefixIndex.match`); where the gateway handed in
   the event-fed index's matches (``exact``: backends whose KV events are in sync), those instead
   (`dispatch.exact`);
3. the in-flight overlay (`prefix_index.PendingChains`: chains of requests routed and not yet
   ended count as held in HBM where they went) and the pool overlay (`with_kv_pool`);
4. `router.types.RequestFeatures` and one `BackendView` per target, then `router.decide`;
5. bookkeeping: `charge` opens a `Ticket` on the chosen target's ledger and marks its chain
   in flight; `record` tells the index the backend (and the pool) now caches the chain;
   `forget` drops a restarted backend (`forget_kv_pool` the pool); `observe_prompt_tokens`
   calibrates bytes per token; `observe_cached_tokens` checks the index's credit against what the
   backend reported (`dispatch.evidence`) and names holders whose entries answers keep contradicting.

Index trouble degrades routing (no prefix match), never the request: a failed call is
reported to the `DispatchHooks` and the request is routed without matches. The pipeline
reads no clock of its own; with hooks it times the index calls and the decision on the
injected clock.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

from dispatch.evidence import CachedTokensCheck, CachedTokensEvidence
from dispatch.exact import engine_pool_model, exact_credit
from dispatch.ledger import Ticket
from dispatch.split import charge_split
from dispatch.views import view_of
from dispatch.request import DispatchHooks, Plan, RoutableRequest
from dispatch.target import Target
from prefix_index import (
    NO_MATCH,
    KV_POOL_ID,
    BlockMatch,
    PendingChains,
    PrefixIndex,
    PrefixIndexError,
    TierCapacity,
    kv_pool_capacity,
    with_kv_pool,
)
from prefix_index.engine_index import ExactMatch
from router import kappa
from router.calibration import BytesPerToken
from router.decide import decide
from router.decode import decode_context_tokens
from router.policies import Policy
from router.types import Candidate, PdFleet, RequestFeatures

__all__ = ["DispatchHooks", "Dispatcher", "Plan", "RoutableRequest"]


class Dispatcher:
    """Owns the routing pipeline's state: the in-flight chains, capacities, calibration.

    Args:
        index: the prefix index (memory or Redis).
        policy: the configured policy (it may keep state, e.g. round-robin's turn).
        rng: randomness for tie-breaks.
        calibration: bytes per token per model (`router.calibration.BytesPerToken`).
        block_size_bytes: the index block in bytes (`prefix_index.block_size_bytes`).
        kv_pool_bytes: capacity of the KV pool the backends share, bytes (``None``: none).
        hooks: index health and timing reports (``None``: nothing is reported or timed, and
            index errors propagate).
        clock: monotonic seconds, read only to time calls for ``hooks`` (required with them).
        gather: awaits several index calls at once. Live, ``asyncio.gather``, so that a Redis
            index sends a backend's record and the pool's in one round trip; the default
            awaits them in turn, which is what the simulator's loop-free driver needs.

    Raises:
        ValueError: ``hooks`` without a ``clock``.
    """

    def __init__(self, index: PrefixIndex, policy: Policy, rng: random.Random, calibration: BytesPerToken, *,
                 block_size_bytes: int, kv_pool_bytes: float | None = None, hooks: DispatchHooks | None = None,
                 clock: Callable[[], float] | None = None,
                 gather: Callable[..., Awaitable[Any]] | None = None) -> None:
        if hooks is not None and clock is None:
            raise ValueError("hooks need a clock to time the calls they report")
        self.index, self.policy, self.rng, self.calibration = index, policy, rng, calibration
        self.gather = gather or _in_turn
        self.block_size_bytes = block_size_bytes
        self.kv_pool_bytes = kv_pool_bytes
        self.hooks = hooks
        self.clock: Callable[[], float] = clock or _no_clock
        self.pending = PendingChains()  # chains of the requests in flight, by backend
        self.pending_engine = PendingChains()  # their engine chains, when the exact index routes them
        # Set by a gateway whose replicas share load (gateway.replicas.peer_load): chains are recorded in the
        # index when sent, so index credit may be a prefill still running (own or a peer's).
        self.records_at_decision = False
        # Set by a gateway whose replicas share load: refreshes the targets' ``peer_*`` figures
        # (`gateway.replicas.peer_load`), awaited together with the index match, so both cost one round trip;
        # ``peer_read_due`` says whether there is anything to read (another replica is known).
        self.peer_load: Callable[[], Awaitable[None]] | None = None
        self.peer_read_due: Callable[[], bool] = _always
        self.evidence = CachedTokensEvidence()  # answers' cached_tokens against the index's credit
        self.forget_epoch = 0  # forgets so far (backends and pool)
        # On a P/D fleet: the backends' roles and the links usable for splits (the owner replaces it
        # when a link's health changes); ``None``: an aggregated fleet, decided as ever.
        self.pd: PdFleet | None = None
        self._capacities: dict[tuple[str, str], tuple[tuple[float, float], TierCapacity]] = {}

    # -- capacities ----------------------------------------------------------------------
    def tokens_per_block(self, model: str) -> float:
        """Tokens one index block stands for: block bytes ÷ the model's bytes per token."""
        return self.block_size_bytes / self.calibration.get(model)

    def capacity(self, target: Target, model: str) -> TierCapacity:
        """A target's KV capacity in index blocks, HBM and host tier (recomputed only when the
        scraped capacity or the bytes/token calibration moved)."""
        inputs = (target.kv_capacity_bytes, self.calibration.get(model))
        cached = self._capacities.get((target.id, model))
        if cached is not None and cached[0] == inputs:
            return cached[1]
        block_kv_bytes = self.tokens_per_block(model) * kappa.b_kv_bytes(target.spec.model)
        capacity = TierCapacity(int(inputs[0] // block_kv_bytes), int(target.host_tier_bytes // block_kv_bytes))
        self._capacities[(target.id, model)] = (inputs, capacity)
        return capacity

    def kv_pool_capacity(self, target: Target, model: str) -> TierCapacity | None:
        """The shared KV pool's capacity in index blocks of ``model`` (None without a pool);
        ``target`` is any backend serving it (for B_kv)."""
        if self.kv_pool_bytes is None:
            return None
        return kv_pool_capacity(self.kv_pool_bytes, self.tokens_per_block(model) * kappa.b_kv_bytes(target.spec.model))

    # -- deciding ------------------------------------------------------------------------
    async def plan(self, request: RoutableRequest, targets: Sequence[Target], *, dry_run: bool = False,
                   split: bool = True, exact: Mapping[str, ExactMatch] | None = None) -> Plan:
        """Rank ``targets`` (healthy, serving ``request.model``, non-empty) for ``request``.

        On a P/D fleet (`pd`) the decision may split the request (`router.types.Decision.prefill`)
        unless ``split`` is False (a client's own ``kv_transfer_params``: the request goes whole
        to a backend that decodes).

        ``dry_run`` (the explain endpoint) decides on copies of the policy and the random
        generator, so explaining a request leaves the next real decision as it would have
        been (round-robin's turn, tie-breaks), and is not timed. ``exact``: the event-fed index's matches
        for the backends in sync, used in place of the index's for them (`dispatch.exact`).

        Raises:
            router.errors.NoEligibleBackend: ``targets`` is empty.
        """
        model = request.model
        capacities = {t.id: self.capacity(t, model) for t in targets}
        kv_pool = self.kv_pool_capacity(targets[0], model) if targets else None
        lookup = capacities if kv_pool is None else {**capacities, KV_POOL_ID: kv_pool}
        # The match first: with asyncio.gather its first step (which queues it for the index's batch
        # of this loop turn) runs before the read's, so the read can ride in that batch (gateway.replicas.peer_load).
        calls: list[Awaitable[Any]] = [self._match(model, request.hashes, lookup)]
        if self.peer_load is not None and self.peer_read_due():
            calls.append(self._peer_read())
        engine_pool = bool(exact) and kv_pool is not None and bool(request.engine_hashes)
        if engine_pool:
            calls.append(self._match_engine_pool(request, targets[0]))
        answers = await self.gather(*calls) if len(calls) > 1 else [await calls[0]]
        matches, index_ok = answers[0]
        matches = self.pending.overlay(model, request.hashes, matches, lookup)
        if kv_pool is not None:
            matches = with_kv_pool(matches, capacities)
        tokens_per_block = self.tokens_per_block(model)
        if exact:  # the exact backends' whole credit in engine blocks (dispatch.exact)
            matches |= exact_credit(exact, model=model, engine_hashes=request.engine_hashes,
                                    engine_block_tokens=request.engine_block_tokens, in_flight=self.pending_engine,
                                    kv_pool=answers[-1] if engine_pool else None, tokens_per_block=tokens_per_block)
        features = RequestFeatures(
            model=model,
            prompt_tokens=request.prompt_tokens or max(round(request.prompt_bytes / self.calibration.get(model)), 1),
            max_tokens=request.max_tokens,
            prompt_blocks=len(request.hashes),
            block_size_tokens=tokens_per_block,
            sequences=request.sequences,
        )
        views = tuple(view_of(t, matches.get(t.id, NO_MATCH), capacities[t.id]) for t in targets)
        pd = self.pd if self.pd is None or split else self.pd.unsplit()
        if dry_run:
            rng = random.Random()
            rng.setstate(self.rng.getstate())
            decision = decide(copy.deepcopy(self.policy), features, views, rng, pd)
        elif self.hooks is None:
            decision = decide(self.policy, features, views, self.rng, pd)
        else:
            start = self.clock()
            decision = decide(self.policy, features, views, self.rng, pd)
            self.hooks.decided(self.clock() - start)
        return Plan(request, features, views, decision, {t.id: t for t in targets}, index_ok, self.forget_epoch)

    async def _peer_read(self) -> None:
        assert self.peer_load is not None
        await self.peer_load()

    async def _match_engine_pool(self, request: RoutableRequest, target: Target) -> BlockMatch | None:
        """The pool's match of the request's engine chain, in engine blocks (`dispatch.exact`); None if
        the index failed."""
        assert self.kv_pool_bytes is not None
        capacity = kv_pool_capacity(self.kv_pool_bytes, request.engine_block_tokens * kappa.b_kv_bytes(target.spec.model))
        matches, ok = await self._match(engine_pool_model(request.model), request.engine_hashes, {KV_POOL_ID: capacity})
        return matches.get(KV_POOL_ID, NO_MATCH) if ok else None

    async def _match(self, model: str, hashes: Sequence[int],
                     capacities: dict[str, TierCapacity]) -> tuple[dict[str, BlockMatch], bool]:
        if not hashes:
            return {}, True
        hooks = self.hooks
        start = self.clock() if hooks is not None else 0.0
        try:
            matches = await self.index.match(model, hashes, capacities)
        except PrefixIndexError as exc:
            if hooks is None:
                raise
            hooks.index_failed("match", exc)
            return {}, False
        if hooks is not None:
            hooks.index_answered("match", self.clock() - start)
        return matches, True

    # -- bookkeeping ---------------------------------------------------------------------
    def charge(self, plan: Plan, candidate: Candidate) -> Ticket:
        """Charge a candidate's KV demand and prefill to its target's ledger, now, and mark its
        chain as in flight there until the ticket finishes: its prefill computes the chain
        into that backend's HBM, and vLLM does not evict the blocks of a running request."""
        target = plan.targets[candidate.backend_id]
        est = candidate.estimate
        model, hashes, engine = plan.request.model, plan.request.hashes, plan.request.engine_hashes
        self.pending.add(model, target.id, hashes)
        self.pending_engine.add(model, target.id, engine)
        features = plan.features
        return Ticket(target.ledger, est.kv_demand_bytes, est.prefill_s,
                      on_finish=lambda: self._ended(model, target.id, hashes, engine),
                      context_tokens=decode_context_tokens(features),
                      output_tokens=float(features.sequences * max(features.max_tokens, 1)))

    def _ended(self, model: str, backend_id: str, hashes: Sequence[int], engine: Sequence[int]) -> None:
        self.pending.remove(model, backend_id, hashes)
        self.pending_engine.remove(model, backend_id, engine)

    def charge_split(self, plan: Plan) -> tuple[Ticket, Ticket]:
        """Charge a split decision to both its backends (`dispatch.split.charge_split`)."""
        return charge_split(self.pending, plan.request.model, plan.request.hashes, plan.features, plan.decision,
                            plan.targets, pending_engine=self.pending_engine, engine_hashes=plan.request.engine_hashes)

    def records_anything(self, hashes: Sequence[int], holders: Literal["both", "backend", "kv_pool"] = "both") -> bool:
        """Whether `record` with these arguments would tell the index anything (a chain, and for
        ``kv_pool`` a pool): the gateway spawns no task for a record that would not."""
        return bool(hashes) and (holders != "kv_pool" or self.kv_pool_bytes is not None)

    async def record(self, model: str, target: Target, hashes: Sequence[int], *,
                     holders: Literal["both", "backend", "kv_pool"] = "both", engine_hashes: Sequence[int] = (),
                     engine_block_tokens: int = 0) -> None:
        """The backend now caches this chain (its prefill ran), and so does the shared KV pool
        if there is one (the backend writes through to it): tell the index, in one batch.

        ``holders``: ``backend`` records the backend alone (a gateway recording a chain when
        it sends the request: the prefill computes it into that backend's HBM, but reaches
        the pool only once done); ``kv_pool`` the pool alone (that request's first byte).
        ``engine_hashes``: the request's engine chain at ``engine_block_tokens``
        (`RoutableRequest.engine_hashes`), recorded under the pool too (`dispatch.exact`)."""
        if not self.records_anything(hashes, holders):
            return
        hooks = self.hooks
        start = self.clock() if hooks is not None else 0.0
        kv_pool = self.kv_pool_capacity(target, model) if holders != "backend" else None
        assert kv_pool is not None or holders != "kv_pool"
        calls = [] if holders == "kv_pool" else [self.index.record(model, target.id, hashes, self.capacity(target, model))]
        if kv_pool is not None:
            calls.append(self.index.record(model, KV_POOL_ID, hashes, kv_pool))
        if kv_pool is not None and engine_hashes and self.kv_pool_bytes is not None:
            engine_capacity = kv_pool_capacity(self.kv_pool_bytes, engine_block_tokens * kappa.b_kv_bytes(target.spec.model))
            calls.append(self.index.record(engine_pool_model(model), KV_POOL_ID, engine_hashes, engine_capacity))
        try:
            await (self.gather(*calls) if len(calls) > 1 else calls[0])
        except PrefixIndexError as exc:
            if hooks is None:
                raise
            hooks.index_failed("record", exc)
            return
        if holders != "kv_pool":
            target.ledger.recorded_blocks += len(hashes)
        if hooks is not None:
            hooks.index_answered("record", self.clock() - start)

    async def forget(self, target: Target) -> bool:
        """Drop everything the index holds for a backend (it restarted with an empty cache, or its
        answers contradict its entries). Returns False if the index failed (reported to the hooks)."""
        if not await self._forget(target.id):
            return False
        target.ledger.recorded_blocks = 0
        return True

    async def forget_kv_pool(self) -> bool:
        """Drop everything the index holds for the shared KV pool (`KV_POOL_ID`). Returns False if
        the index failed (reported to the hooks)."""
        return await self._forget(KV_POOL_ID)

    async def _forget(self, holder: str) -> bool:
        try:
            await self.index.forget(holder)
        except PrefixIndexError as exc:
            if self.hooks is None:
                raise
            self.hooks.index_failed("forget", exc)
            return False
        self.forget_epoch += 1
        self.evidence.forgotten(holder, self.forget_epoch)
        return True

    def observe_cached_tokens(self, plan: Plan, candidate: Candidate, reported_tokens: int) -> CachedTokensCheck:
        """Check the credit ``candidate`` was routed on against the ``cached_tokens`` its backend
        reported (`dispatch.evidence.CachedTokensEvidence.observe`): the outcome within one block,
        over or under, and the holders to forget (`forget`, `forget_kv_pool`), usually none."""
        view = next((v for v in plan.views if v.backend_id == candidate.backend_id), None)
        in_flight_blocks = view.in_flight_blocks if view is not None else 0
        block_tokens = plan.features.block_size_tokens
        in_flight_tokens = min(int(in_flight_blocks * block_tokens), candidate.cached_hbm_tokens)
        if self.records_at_decision and view is not None and view.outstanding_prefill_s > 0:
            # A prefill was running there (this replica's or a peer's) and the index already held
            # its chain: the credit may be that prefill's, which vLLM caches only as it completes.
            in_flight_tokens = candidate.cached_hbm_tokens
        return self.evidence.observe(
            candidate.backend_id, local_tokens=candidate.cached_hbm_tokens + candidate.cached_host_tokens,
            in_flight_tokens=in_flight_tokens,
            kv_pool_tokens=candidate.cached_kv_pool_tokens, reported_tokens=reported_tokens,
            block_tokens=block_tokens, epoch=plan.index_epoch)

    def observe_prompt_tokens(self, model: str, prompt_bytes: int, prompt_tokens: int) -> bool:
        """Fold a response's ``usage.prompt_tokens`` into the bytes/token calibration; False if
        the sample was implausible and ignored (`router.calibration.BytesPerToken.observe`)."""
        return self.calibration.observe(model, prompt_bytes, prompt_tokens)


def _no_clock() -> float:
    return 0.0


def _always() -> bool:
    return True


async def _in_turn(*calls: Awaitable[Any]) -> list[Any]:
    return [await call for call in calls]
