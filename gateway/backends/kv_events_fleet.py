"""Every backend's KV-event subscriber, held and supervised; what routing and the operator read.

The lifespan (`gateway.lifespan`) opens one `KvEventsFleet` with the exact index (memory, or
Redis when the approximate index is in Redis: `prefix_index.engine_redis`, shared by replicas),
starts it after the backend set, and stops it before the index closes. Backends without a
``kv_events`` entry are ``approximate`` for good. A subscriber that dies of an unexpected error is
logged with its traceback and restarted a second later (a supervisor, so that one backend's bad
stream never ends the gateway's); the restarted subscriber catches up from the index. A supervised
task that ends anyway (cancelled by something other than `KvEventsFleet.stop`) is logged and
started again at once, and counted (``task_restarts`` in the backend's view).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

import zmq.asyncio

from fleet_config.settings import BackendEntry
from gateway.backends.kv_events import KvEventSubscriber, Mode
from gateway.telemetry.kv_events import KvEventsTelemetry
from prefix_index import PrefixIndexError
from prefix_index.engine_chain import request_chain
from prefix_index.engine_events import Tier
from prefix_index.engine_index import NO_EXACT_MATCH, EngineIndex, ExactMatch

__all__ = ["KvEventsFleet", "SUPERVISOR_RESTART_S", "TokenIdsOf", "engine_chain_of", "request_token_ids"]

# The engines' tokenizer for a request: (model, body, chat) -> its prompt's token ids, or None (no
# tokenizer for that model). Issue 30's `tokenization.request_token_ids` fills it; without it, only
# completions whose prompt is token ids route exactly.
TokenIdsOf = Callable[[str, Mapping[str, Any], bool], Sequence[int] | None]

log = logging.getLogger("kappa_gateway.kv_events")

SUPERVISOR_RESTART_S = 1.0  # a crashed subscriber's pause before its restart


class KvEventsFleet:
    """The subscribers of every backend with ``kv_events``, and the exact index they feed.

    Args:
        backends: the configured backends (those without ``kv_events`` stay approximate).
        index: the exact index (the caller owns and closes it).
        telemetry: the KV-event metrics.
        start_time_of: a backend id -> its scraped ``process_start_time_seconds`` (or None).
        subscriber_options: keyword arguments for each `KvEventSubscriber` (timeouts, clock).
    """

    def __init__(self, backends: Sequence[BackendEntry], index: EngineIndex, telemetry: KvEventsTelemetry, *,
                 start_time_of: Callable[[str], float | None] = lambda backend_id: None,
                 **subscriber_options: Any) -> None:
        self.index = index
        self._telemetry = telemetry
        self._start_time_of = start_time_of
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self.task_restarts: dict[str, int] = {}
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self.lookup_errors = 0
        for b in backends:
            telemetry.init_backend(b.id)
            if b.kv_events is not None:
                self.subscribers[b.id] = KvEventSubscriber(b.id, b.model, b.kv_events, index, self._context,
                                                           telemetry, **subscriber_options)

    @property
    def tasks(self) -> Mapping[str, asyncio.Task[None]]:
        """Backend id -> its supervised subscriber task (read-only; for tests and debugging)."""
        return MappingProxyType(self._tasks)

    def start(self) -> None:
        """Start one supervised task per subscriber."""
        self._stopping = False
        for subscriber in self.subscribers.values():
            self._start_task(subscriber)

    def _start_task(self, subscriber: KvEventSubscriber) -> None:
        task = asyncio.create_task(self._supervise(subscriber), name=f"kv-events-{subscriber.backend_id}")
        task.add_done_callback(partial(self._task_ended, subscriber))
        self._tasks[subscriber.backend_id] = task

    def _task_ended(self, subscriber: KvEventSubscriber, task: asyncio.Task[None]) -> None:
        """A supervised task ended outside `stop` (cancelled from elsewhere): start it again, counted."""
        if self._stopping or self._tasks.get(subscriber.backend_id) is not task:
            return
        if not task.cancelled() and not isinstance(task.exception(), Exception):
            return  # SystemExit, KeyboardInterrupt: the process is ending
        self.task_restarts[subscriber.backend_id] = self.task_restarts.get(subscriber.backend_id, 0) + 1
        log.warning("KV events of backend %s: the subscriber task ended (%s); starting it again",
                    subscriber.backend_id, "cancelled" if task.cancelled() else repr(task.exception()))
        self._start_task(subscriber)

    async def stop(self) -> None:
        """Cancel and await the subscribers, then close the ZMQ context."""
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        self._context.destroy(linger=0)

    async def _supervise(self, subscriber: KvEventSubscriber) -> None:
        start_s = lambda: self._start_time_of(subscriber.backend_id)  # noqa: E731
        while True:
            try:
                await subscriber.run(restart_start_s=start_s)
            except Exception:  # noqa: BLE001 -- the supervisor's one job: a crash is logged and restarted
                log.exception("KV events of backend %s: the subscriber crashed; restarting it in %g s",
                              subscriber.backend_id, SUPERVISOR_RESTART_S)
            await asyncio.sleep(SUPERVISOR_RESTART_S)

    def engine_restarted(self, backend_id: str) -> None:
        """The scrape saw the backend restart (`gateway.backends.backend_set`): its subscriber resyncs."""
        subscriber = self.subscribers.get(backend_id)
        if subscriber is not None:
            subscriber.on_engine_restart()

    def any_exact(self, model: str) -> bool:
        """Whether some backend of ``model`` routes on its events now (worth the request's token ids)."""
        return any(s.model == model and s.mode is Mode.EXACT for s in self.subscribers.values())

    def mode(self, backend_id: str) -> Mode:
        subscriber = self.subscribers.get(backend_id)
        return Mode.APPROXIMATE if subscriber is None else subscriber.mode

    async def exact_matches(self, model: str, token_ids: Sequence[int], backend_ids: Sequence[str], *,
                            cache_salt: str | None = None) -> dict[str, ExactMatch]:
        """The exact index's matches for the candidates in ``exact`` mode (the others are absent: they
        route on the approximate index). One round trip; a failing store answers ``{}`` (counted in
        ``lookup_errors``: routing degrades to approximate, the request goes on), and so does a token id
        past 2**32.
        """
        sizes: dict[str, int] = {}
        out: dict[str, ExactMatch] = {}
        for backend_id in backend_ids:
            subscriber = self.subscribers.get(backend_id)
            if subscriber is None or subscriber.mode is not Mode.EXACT:
                continue
            size = subscriber.state.block_size_tokens if subscriber.state is not None else None
            if size:
                sizes[backend_id] = size
            else:  # exact and empty, or no block stored yet: nothing cached there
                out[backend_id] = NO_EXACT_MATCH
        if not sizes:
            return out
        try:
            return out | await self.index.match(model, token_ids, sizes, cache_salt=cache_salt)
        except ValueError:  # a token id past 2**32: no engine's; routed on the approximate index
            return {}
        except PrefixIndexError as exc:
            self.lookup_errors += 1
            log.debug("exact index lookup failed (%s): routing on the approximate index", exc)
            return {}

    def view(self, backend_id: str) -> dict[str, Any]:
        """The ``kv_events`` object of a backend in ``/v1/kappa/backends``."""
        subscriber = self.subscribers.get(backend_id)
        if subscriber is None:
            return {"mode": Mode.APPROXIMATE.value, "reason": "no kv_events configured"}
        mode, reason = subscriber.mode_and_reason()
        state = subscriber.state
        return {
            "mode": mode.value, "reason": reason, "endpoint": subscriber.entry.endpoint,
            "replay_endpoint": subscriber.entry.replay_endpoint, "topic": subscriber.entry.topic,
            "last_seq": None if state is None else state.last_seq, "clean": None if state is None else state.clean,
            "block_size_tokens": None if state is None else state.block_size_tokens,
            "exact_blocks": {t.value: 0 if state is None else state.blocks.get(t, 0) for t in Tier},
            "engine_blocks": 0 if state is None else state.engine_blocks,
            "batches": dict(subscriber.counts), "stream_restarts": subscriber.stream_restarts,
            "task_restarts": self.task_restarts.get(backend_id, 0),
        }


def request_token_ids(model: str, body: Mapping[str, Any], chat: bool, tokenize: TokenIdsOf | None
                      ) -> tuple[int, ...] | None:
    """The prompt's token ids, or None (the request routes on the approximate index).

    A completion whose ``prompt`` is one list of token ids needs no tokenizer (the canonicaliser has
    checked every id already: `prefix_index.completion_prompts`); anything else needs ``tokenize``. A
    batch of prompts is several requests to vLLM: None. A tokenizer that fails (``ValueError``) gives None.
    """
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return tuple(prompt)
    if tokenize is None or (not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], list)):
        return None
    try:
        ids = tokenize(model, body, chat)
    except ValueError as exc:
        log.debug("no token ids for a %s request to %s (%s): routed approximately", "chat" if chat else
                  "completion", model, exc)
        return None
    return None if ids is None else tuple(ids)


def engine_chain_of(model: str, token_ids: Sequence[int], exact: Mapping[str, ExactMatch],
                    cache_salt: str | None, scraped: Mapping[str, int | None]) -> tuple[list[int], int]:
    """A request's engine chain for the exact backends' in-flight and KV-pool credit (`dispatch.exact`):
    its own hashes (`prefix_index.engine_chain.request_chain`) at the block size most of ``exact``'s
    backends use, and that size; ``([], 0)`` when none is known. A backend's size is the one its events
    announced, else the one its ``/metrics`` shows (``scraped``: backend id -> ``vllm:cache_config_info``'s
    ``block_size``), so the first requests to an empty fleet have a chain too (the pool is filled from them)."""
    sizes = [m.block_size_tokens or scraped.get(b) for b, m in exact.items()]
    known = [s for s in sizes if s]
    if not known:
        return [], 0
    size = max(set(known), key=known.count)
    return request_chain(model, token_ids, size, cache_salt), size  # the match's own, not hashed again
