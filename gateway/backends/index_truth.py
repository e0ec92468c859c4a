"""Keeping the prefix index true to the backends, from evidence the gateway already has.

The index believes a backend caches what it was last sent. Three things make that stale,
and each is caught here and answered by forgetting (``gateway_index_resets_total{backend,
reason}``, one warning per holder and reason, later ones at debug level):

* ``restart``: a backend's ``/metrics`` shows a new ``process_start_time_seconds``, or one
  of vLLM's counters went backwards (`gateway.backends.backend_set`): its entries are forgotten.
* ``kv-pool-backends-restarted``: every backend sharing the KV pool restarted within
  `KV_POOL_RESTART_WINDOW_S` of each other. The gateway cannot scrape the pool itself; a
  fleet that restarts as one (``kappa-gateway mock-fleet`` runs its mocks and their pool in
  one process) has restarted its pool with it, so the pool's entries are forgotten too
  (kept, they price requests as pool loads of prefixes the pool no longer holds).
* ``cached-tokens-shortfall``: answers keep reporting far fewer ``cached_tokens`` than the
  index credited (`dispatch.evidence`): a backend emptied by ``POST /reset_prefix_cache``
  (vLLM's counters do not move then), restarted between two scrapes with nothing to tell,
  or a pool that lost its contents. The holder is forgotten, then the answering request's
  chain recorded again (its backend has just prefilled it, and written it to the pool).

Every answer with usage is also counted by outcome (``gateway_index_predictions_total``):
predicted K within one index block of the reported cached tokens, over, or under.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dispatch import Dispatcher, Plan
from gateway.backends.backend_set import BackendSet
from gateway.backends.backend_state import BackendState
from gateway.telemetry.metrics import Telemetry
from prefix_index import KV_POOL_ID
from router.types import Candidate

log = logging.getLogger("kappa_gateway.index")

# Restarts of every pool-sharing backend this close together are one fleet restart. A fleet's
# processes come back within seconds of each other and each is seen at its first scrape after
# (health + scrape intervals: 2 s at most by default); 30 s is `mock-fleet`'s own start-up
# allowance (gateway.commands.fleet.READY_TIMEOUT_S), while rolling restarts of a real fleet
# are minutes apart.
KV_POOL_RESTART_WINDOW_S = 30.0


class IndexTruth:
    """Forgets what the evidence contradicts (module docstring); built once by `RoutingService`.

    Args:
        dispatcher: the routing pipeline (its index, forgets, and evidence).
        backends: the backend set (states by id; every backend shares the pool, if any).
        telemetry: where predictions and resets are counted.
        clock: monotonic seconds (for the fleet-restart window).
        kv_pool: the fleet has a shared KV pool.
    """

    def __init__(self, dispatcher: Dispatcher, backends: BackendSet, telemetry: Telemetry,
                 clock: Callable[[], float], *, kv_pool: bool) -> None:
        self._dispatcher, self._backends, self._telemetry, self._clock = dispatcher, backends, telemetry, clock
        self._kv_pool = kv_pool
        self._restarted_at_s: dict[str, float] = {}
        self._warned: set[tuple[str, str]] = set()
        self._predictions: dict[tuple[str, str], Any] = {}  # (backend, outcome) -> its counter child

    def observe(self, plan: Plan, candidate: Candidate, reported_tokens: int) -> tuple[str, ...]:
        """Count one answer's outcome; return the holders its evidence makes stale (usually
        none), for `forget_stale` to drop off the request path."""
        check = self._dispatcher.observe_cached_tokens(plan, candidate, reported_tokens)
        key = (candidate.backend_id, check.outcome)
        counter = self._predictions.get(key)
        if counter is None:  # resolved once per series: labels() costs microseconds a call
            counter = self._predictions[key] = self._telemetry.index_predictions.labels(*key)
        counter.inc()
        return check.stale

    async def forget_stale(self, holders: Sequence[str], plan: Plan, state: BackendState) -> None:
        """Forget ``holders`` (backend ids, `KV_POOL_ID`) whose credit answers keep contradicting,
        then record ``plan``'s chain on ``state`` again (and on the pool): it has just served it."""
        for holder in holders:
            if holder == KV_POOL_ID:
                done = await self._dispatcher.forget_kv_pool()
            else:
                done = await self._dispatcher.forget(self._backends.by_id[holder])
            if done:
                self._reset(holder, "cached-tokens-shortfall",
                            f"its answers reported under half the cached tokens the index credited, "
                            f"{self._dispatcher.evidence.miss_streak} times in a row")
        request = plan.request
        await self._dispatcher.record(request.model, state, request.hashes, engine_hashes=request.engine_hashes,
                                      engine_block_tokens=request.engine_block_tokens)

    async def restarted(self, backend_id: str) -> None:
        """A backend restarted (`gateway.backends.backend_set.BackendSet`): forget it, and the pool if every
        backend sharing it has now restarted within `KV_POOL_RESTART_WINDOW_S`."""
        if await self._dispatcher.forget(self._backends.by_id[backend_id]):
            self._reset(backend_id, "restart")  # the backend set has logged the restart
        if not self._kv_pool:
            return
        now_s = self._clock()
        self._restarted_at_s[backend_id] = now_s
        if all(now_s - self._restarted_at_s.get(s.id, -KV_POOL_RESTART_WINDOW_S - 1) <= KV_POOL_RESTART_WINDOW_S
               for s in self._backends.states):
            self._restarted_at_s.clear()
            if await self._dispatcher.forget_kv_pool():
                self._reset(KV_POOL_ID, "kv-pool-backends-restarted",
                            "every backend sharing it restarted: the pool restarted with them")

    def _reset(self, holder: str, reason: str, why: str | None = None) -> None:
        self._telemetry.index_resets.labels(holder, reason).inc()
        if why is None:
            return
        level = logging.DEBUG if (holder, reason) in self._warned else logging.WARNING
        self._warned.add((holder, reason))
        log.log(level, "prefix index: forgot every entry of %s: %s", holder, why)
