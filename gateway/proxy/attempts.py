"""Getting a request's first byte: attempts on the ranked backends under one deadline.

As Envoy's router does (``retry_on``, ``num_retries``, ``per_try_timeout``, the route
``timeout``), but for an LLM's first byte:

- **One deadline.** ``upstream_first_byte_timeout_s`` runs from the gateway's receipt of the
  request over every attempt; ``upstream_per_try_timeout_s`` optionally caps each one.
- **Phases of an attempt** (`gateway.upstream.request.open_response`): a streamed request's headers
  come at once from vLLM, so they are bounded by the idle timeout and its first event by the
  deadline (the queue and the prefill); a non-streamed answer comes whole after the
  generation, so its headers are bounded by the deadline and its first bytes by the idle
  timeout. Missing an idle bound counts as the backend's failure.
- **While it waits** for the first byte the attempt also watches the client (a disconnect
  cancels it within one event-loop turn: the upstream connection is closed and every charge
  released, and nothing is retried for a client that has gone), the backend when another
  backend is left to try (if it leaves rotation — ``unhealthy_threshold`` failed health
  checks, or an ejection — the attempt moves there: a SIGSTOPped backend otherwise holds its
  requests until the deadline; with nowhere to go, a health check alone never cuts it) and
  the process (past the shutdown grace period it answers 503).
- **Retries** go to the next backend of the ranking when the failure's kind is in
  ``retry.retry_on`` (default connect failures, resets and 5xx, not timeouts) or it is such
  a move, at most ``retry.max_retries`` times, never for a body over ``retry.max_body_bytes``.
  A 5xx whose body says the request is bad (a prompt over the context length,
  `gateway.upstream.engine_errors`) is relayed as it came, like a 4xx: never retried.
- **Outcomes** before the first byte — connect failures, resets, 5xx, hangs — count toward
  the backend's outlier ejection (`gateway.backends.rotation`); a complete answer (the relay)
  starts its count again.
- **Each attempt has its own X-Request-Id** (`gateway.upstream.request.attempt_request_id`).
- **A split request's decode phase** (`gateway.proxy.disagg`) is the first attempt. A streamed one
  whose first event is an error event (vLLM's answer when the KV pull failed under
  ``kv_load_failure_policy: fail``: its 200 is sent before the engine reports the failed load) is
  a 5xx before the first byte, like the non-streamed answer's 500: the request goes whole to the
  next backend instead of ending on that error.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict
from starlette.requests import Request

from dispatch import Plan, Ticket
from gateway.backends.backend_state import BackendState
from gateway.edge.scope import CLIENT_GONE
from gateway.errors import (
    ClientGone,
    ShuttingDown,
    UpstreamError,
    UpstreamLeftRotation,
    UpstreamReset,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.backends.kappa_feed import DispatchTiming
from gateway.proxy.sse import leading_error
from gateway.state import GatewayState
from gateway.upstream.request import Bound, attempt_request_id, open_response
from router.types import Candidate

log = logging.getLogger("kappa_gateway.proxy")


@dataclass(slots=True)
class FirstByte:
    """An attempt that got its first byte: where, its charges, and the open response."""

    candidate: Candidate
    state: BackendState
    ticket: Ticket
    resp: aiohttp.ClientResponse
    first: bytes
    timing: DispatchTiming  # its queue and headers time (gateway.backends.kappa_feed)
    prefill_backend: str | None = None  # a split request's decode phase: where it was prefilled (none ran here)

    @property
    def split(self) -> bool:
        return self.prefill_backend is not None


@dataclass(slots=True)
class SplitAttempt:
    """The decode phase of a split request, as the first attempt: its body (the client's, with the
    prefill's ``kv_transfer_params``) and its ticket (`dispatch.Dispatcher.charge_split`)."""

    body: bytes
    ticket: Ticket
    prefill_backend: str


class ClientWatch:
    """Notices the client disconnecting while the gateway waits on a backend. Under the
    gateway's own server the connection tells it (`gateway.edge.scope.CLIENT_GONE`); under
    another ASGI server a task reads the request's next ASGI message, which after the body
    is ``http.disconnect``. Stop it before handing the connection to a streaming response,
    which listens for that message itself."""

    __slots__ = ("_request", "_signal")

    def __init__(self, request: Request) -> None:
        self._request = request
        self._signal: asyncio.Future[None] | None = None

    @property
    def signal(self) -> asyncio.Future[None]:
        if self._signal is None:
            client_gone = self._request.scope.get(CLIENT_GONE)
            self._signal = client_gone() if client_gone is not None else asyncio.ensure_future(self._disconnected())
        return self._signal

    async def _disconnected(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass

    def stop(self) -> None:
        if self._signal is not None and not self._signal.done():
            self._signal.cancel()


async def first_byte(gw: GatewayState, plan: Plan, body: bytes, headers: CIMultiDict[str], watch: ClientWatch, *,
                     path: str, received_s: float, request_id: str, stream: bool,
                     split: SplitAttempt | None = None, own_kv_transfer: bool = False) -> FirstByte:
    """Send ``body`` to the ranked backends in turn until one gives a first byte (module docstring).

    With ``split``, the first attempt is a split request's decode phase (its own body and ticket; no
    prefill runs there, so the κ_crit feed is not told); a retry goes whole (aggregated, ``body``) to
    the next backend of the ranking. ``own_kv_transfer`` (the client's own ``kv_transfer_params``):
    one attempt, and its failure is not counted toward the backend's ejection (the KV it names lives
    elsewhere: a failed load there is no sign of this backend's health).

    Raises:
        UpstreamError: the last attempt's failure, when it may not be retried or nothing is
            left to try (an `UpstreamTimeout` when the deadline ran out first).
        ClientGone: the client disconnected first.
        ShuttingDown: the shutdown grace period ended first.
    """
    g = gw.settings.gateway
    policy = g.retry
    deadline_s = received_s + g.upstream_first_byte_timeout_s
    per_try_s = g.upstream_per_try_timeout_s or math.inf
    idle_s = g.upstream_idle_timeout_s
    attempts = 1 + policy.max_retries if len(body) <= policy.max_body_bytes and not own_kv_transfer else 1
    ranked = plan.decision.ranked[:attempts]
    for n, candidate in enumerate(ranked):
        remaining_s = deadline_s - gw.clock()
        if remaining_s <= 0:
            raise UpstreamTimeout(f"no backend gave a first byte within {g.upstream_first_byte_timeout_s:g}s "
                                  f"(the request's deadline, over {n} attempts)")
        try_s = min(remaining_s, per_try_s)
        waited = Bound(min(try_s, idle_s), idle=idle_s < try_s)
        whole = Bound(try_s, idle=False)
        state = plan.targets[candidate.backend_id]
        feed, sent_s = state.prefill_feed, gw.clock()
        decode_phase = split is not None and n == 0
        if decode_phase:
            assert split is not None
            ticket, payload, sequence = split.ticket, split.body, -1
        else:
            sequence = feed.sent(sent_s, candidate)
            ticket, payload = gw.routing.charge(plan, candidate), body
        # Other replicas learn of the prefill in flight through the index (gateway.replicas.peer_load).
        if gw.peers is not None and gw.routing.dispatcher.records_anything(plan.request.hashes, "backend"):
            gw.spawn(gw.routing.record(plan.request.model, state, plan.request.hashes, holders="backend"))
        up_headers = headers.copy()
        up_headers["X-Request-Id"] = attempt_request_id(request_id)
        attempt = asyncio.ensure_future(open_response(
            gw.session, state.entry.url + path, payload, up_headers,
            headers_bound=waited if stream else whole, first_byte_bound=whole if stream else waited, clock=gw.clock))
        last = n == len(ranked) - 1
        down = None if last else gw.backends.down_signal(state)  # nowhere to move to: health alone never cuts it
        try:
            resp, first, headers_s = await first_of(attempt, watch.signal, down, gw.stopping_signal(), state.id)
            if decode_phase and stream and resp.status == 200 and (message := leading_error(first)) is not None:
                resp.close()  # its KV never arrived (module docstring): nothing reached the client yet
                raise UpstreamStatus(f"the decode phase's stream began with an error event: {message}",
                                     upstream_status=500)
        except UpstreamError as exc:
            ticket.finish()  # the ledger and the in-flight chain are released on every path
            if not decode_phase:
                feed.failed(sequence, gw.clock())
            account_failure(gw, state, exc, eject=not own_kv_transfer)
            last_try = last or (exc.retry_kind not in policy.retry_on and not exc.moves)
            if last_try:
                raise
            gw.telemetry.retries.labels(state.id).inc()
            log.warning("request %s: %s failed before the first byte (%s), retrying on %s: %s", request_id,
                        state.id, exc.retry_kind, ranked[n + 1].backend_id, exc.message)
            continue
        except BaseException:
            ticket.finish()
            if not decode_phase:
                feed.failed(sequence, gw.clock())
            raise
        if stream and not decode_phase:  # a stream's first byte is its first token (vLLM sends the role chunk with it)
            feed.first_token(sequence, gw.clock())
        timing = DispatchTiming(sent_s, sequence, headers_s, stream)
        ticket.first_byte()
        return FirstByte(candidate, state, ticket, resp, first, timing,
                         split.prefill_backend if decode_phase and split is not None else None)
    raise AssertionError("unreachable: the ranking is never empty")  # pragma: no cover


async def first_of(attempt: asyncio.Future[Any], gone: asyncio.Future[None], down: asyncio.Future[str] | None,
                    stopping: asyncio.Future[None], backend: str) -> Any:
    """The attempt's result, unless the client leaves, the backend leaves rotation (``down``,
    when given) or the grace period ends first: then the attempt is cancelled (its connection
    closed) and that is raised.

    The three signals cancel the attempt from their done callbacks (no `asyncio.wait` and its
    waiter per request); a cancellation of this task cancels the attempt too and propagates.
    """
    interrupted: list[asyncio.Future[Any]] = []

    def interrupt(signal: asyncio.Future[Any]) -> None:
        if not interrupted:
            interrupted.append(signal)
            attempt.cancel()

    signals = (gone, stopping) if down is None else (gone, down, stopping)
    for signal in signals:
        signal.add_done_callback(interrupt)
    try:
        return await attempt
    except asyncio.CancelledError:
        if not interrupted or _cancelling():
            raise
    finally:
        for signal in signals:
            signal.remove_done_callback(interrupt)
    if interrupted[0] is gone:
        raise ClientGone(backend)
    if down is not None and interrupted[0] is down:
        raise UpstreamLeftRotation(f"backend left rotation before its first byte ({down.result()})")
    raise ShuttingDown("The gateway is shutting down.")


def _cancelling() -> int:
    """How many cancellations of the current task are pending (``Task.cancelling``)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def account_failure(gw: GatewayState, state: BackendState, exc: UpstreamError, *, eject: bool = True) -> None:
    """Count a failure before the first byte; the backend's own (not a deadline that ran out)
    count toward its ejection (unless ``eject`` is False), 502/503/504 and connection failures as
    gateway failures (Envoy's)."""
    gw.telemetry.upstream_failures.labels(state.id, exc.retry_kind).inc()
    if not eject:
        return
    if isinstance(exc, UpstreamStatus):
        gw.backends.failed(state, exc.message, gateway_failure=exc.upstream_status in GATEWAY_FAILURE_STATUSES)
    elif isinstance(exc, (UpstreamUnavailable, UpstreamReset)) or exc.eject:
        gw.backends.failed(state, exc.message)


GATEWAY_FAILURE_STATUSES = frozenset({502, 503, 504})  # Envoy's consecutive_gateway_failure codes
