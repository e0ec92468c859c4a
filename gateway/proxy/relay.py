"""Relaying a backend's response after its first byte, and settling the request exactly once.

A stream passes to the client as the backend sends it, complete SSE events at a time
(`gateway.proxy.sse.SseObserver`), and always ends in one of three ways:

- the backend's own end (bytes unchanged; also after ``data: [DONE]`` when the backend then
  resets or closes uncleanly: the stream was complete, it counts as ``ok`` with its usage);
- an SSE error event and ``data: [DONE]`` from the gateway, never a silent cut: when the
  backend fails mid-stream (``upstream_error``, 502), stays silent past the idle timeout
  (``timeout_error``, 504, counted toward the backend's ejection), or the shutdown grace period ends
  (``service_unavailable_error``, 503);
- the client leaving (the upstream request is closed, so the backend aborts it); after the
  client took ``data: [DONE]`` its leaving is the end of a complete stream, counted ``ok``.

A non-streamed body is read whole, each read bounded by the idle timeout, racing the client's
disconnect and the end of the grace period.

Settling releases the ticket, counts ``gateway_requests_total{status}`` and, for a complete
answer, observes the time to its response headers, TTFT, ITL, E2E, κ, the prompt tokens by
source, the measured κ_crit fit (`gateway.backends.kappa_feed`) and the usage the backend reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import suppress

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dispatch import Plan
from prefix_index import Finding
from gateway.upstream.errors import Phase, mapped_errors
from gateway.proxy.attempts import ClientWatch, FirstByte
from gateway.edge.access_log import invalidation_fields
from gateway.edge.scope import CLIENT_GONE
from gateway.errors import ClientGone, ShuttingDown, UpstreamError, UpstreamReset, UpstreamTimeout
from gateway.proxy.sse import SseObserver, error_tail, usage_from_body
from gateway.routing import ParsedRequest
from gateway.state import GatewayState

log = logging.getLogger("kappa_gateway.proxy")


class _Stopped(Exception):
    """Set on a stream's reader by `Relay.stop` (the shutdown grace period ended)."""


class Relay:
    """Relays one upstream response and settles its ticket, metrics and usage exactly once."""

    __slots__ = ("gw", "plan", "sent", "observer", "_settled", "request_id", "route", "request_bytes",
                 "response_bytes")

    def __init__(self, gw: GatewayState, plan: Plan, sent: FirstByte, received_s: float, *, request_id: str = "-",
                 route: str = "-", request_bytes: int = 0) -> None:
        self.gw, self.plan, self.sent = gw, plan, sent
        self.observer = SseObserver(received_s)
        self._settled = False
        self.request_id, self.route, self.request_bytes, self.response_bytes = request_id, route, request_bytes, 0

    def stop(self) -> None:
        """End this stream now with a 503 error event (the grace period is over)."""
        self.sent.resp.content.set_exception(_Stopped())

    async def stream(self) -> AsyncIterator[bytes]:
        gw, resp, obs = self.gw, self.sent.resp, self.observer
        idle_s = gw.settings.gateway.upstream_idle_timeout_s
        backend = self.sent.state.id
        outcome = "client_disconnect"
        gw.streams.add(self)
        try:
            chunk = self.sent.first
            while True:
                out = obs.feed(chunk, gw.clock())
                if out:
                    self.response_bytes += len(out)
                    yield out
                    if obs.done:
                        # The client took `data: [DONE]`: the stream is complete for it, whether the
                        # backend's end or the client's leaving (a client library closes at [DONE])
                        # comes first.
                        outcome = "ok"
                try:
                    async with asyncio.timeout(idle_s):
                        with mapped_errors(Phase.STREAM, backend):
                            chunk = await resp.content.readany()
                except _Stopped:
                    if obs.done:  # complete: nothing to cut short
                        break
                    outcome = "shutdown"
                    yield error_tail("The gateway is shutting down; the response was cut short.",
                                     ShuttingDown.error_type, ShuttingDown.status)
                    return
                except (UpstreamError, TimeoutError) as exc:  # TimeoutError: the idle timeout's or aiohttp's
                    if obs.done:  # the stream was complete: an unclean close after [DONE] adds nothing
                        break
                    outcome = self._failed_mid_stream(exc, idle_s)
                    if isinstance(exc, TimeoutError):
                        yield error_tail(f"backend {backend} sent nothing for {idle_s:g}s (the idle timeout)",
                                         UpstreamTimeout.error_type, UpstreamTimeout.status)
                    else:
                        yield error_tail(exc.message, UpstreamReset.error_type, UpstreamReset.status)
                    return
                if not chunk:
                    rest = obs.flush()
                    if rest:
                        self.response_bytes += len(rest)
                        yield rest
                    break
            outcome = "ok"
        finally:
            gw.streams.discard(self)
            self.settle(outcome)

    def _failed_mid_stream(self, exc: UpstreamError | TimeoutError, idle_s: float) -> str:
        gw, state = self.gw, self.sent.state
        if isinstance(exc, TimeoutError):
            gw.telemetry.upstream_failures.labels(state.id, "idle-timeout").inc()
            gw.backends.failed(state, f"silent for {idle_s:g}s mid-stream")
            return "upstream_timeout"
        gw.telemetry.upstream_failures.labels(state.id, "mid-stream").inc()
        log.warning("backend %s failed mid-stream: %r", state.id, exc.__cause__ or exc)
        return "upstream_error"

    async def body(self, watch: ClientWatch) -> bytes:
        """The whole non-streamed body.

        Raises:
            UpstreamTimeout: silent past the idle timeout (counted toward the backend's ejection).
            UpstreamReset: the connection dropped mid-body.
            ClientGone: the client left first (the upstream request is closed).
            ShuttingDown: the grace period ended first.
        """
        resp, first = self.sent.resp, self.sent.first
        if resp.content.at_eof():  # the whole body came with the first bytes: nothing to wait for
            return self._body_read(first)
        read = asyncio.ensure_future(self._read_rest(first))
        stopping = self.gw.stopping_signal()
        done, _ = await asyncio.wait({read, watch.signal, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if read not in done:
            read.cancel()
            with suppress(asyncio.CancelledError, UpstreamReset, UpstreamTimeout):
                await read
            if stopping in done:
                self.settle("shutdown")
                stopped = ShuttingDown("The gateway is shutting down.")
                stopped.counted = True
                raise stopped
            self.settle("client_disconnect")
            raise ClientGone(self.sent.state.id, counted=True)
        try:
            body = read.result()
        except (UpstreamTimeout, UpstreamReset) as exc:
            self.settle("upstream_timeout" if isinstance(exc, UpstreamTimeout) else "upstream_error")
            exc.counted = True
            raise
        return self._body_read(body)

    async def _read_rest(self, first: bytes) -> bytes:
        gw, resp, state = self.gw, self.sent.resp, self.sent.state
        idle_s = gw.settings.gateway.upstream_idle_timeout_s
        chunks = [first]
        try:
            while True:
                async with asyncio.timeout(idle_s):
                    with mapped_errors(Phase.BODY, state.id):
                        chunk = await resp.content.readany()
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        except TimeoutError as exc:  # the idle timeout's, or aiohttp's read timeout (mapped: UpstreamTimeout)
            gw.telemetry.upstream_failures.labels(state.id, "idle-timeout").inc()
            gw.backends.failed(state, f"silent for {idle_s:g}s mid-body")
            raise UpstreamTimeout(f"backend {state.id} sent nothing for {idle_s:g}s mid-body (the idle timeout)",
                                  eject=True) from exc
        except UpstreamReset:  # from mapped_errors
            gw.telemetry.upstream_failures.labels(state.id, "mid-stream").inc()
            raise

    def _body_read(self, body: bytes) -> bytes:
        status = self.sent.resp.status
        usage = usage_from_body(body) if status < 400 else None
        if usage:
            self.observer.usage = usage
        self.response_bytes = len(body)
        self.settle("ok" if status < 400 else f"upstream_{status // 100}xx")
        return body

    def settle(self, outcome: str) -> None:
        """Release the request's charges and record its outcome (once; later calls do nothing)."""
        if self._settled:
            return
        self._settled = True
        gw, sent, est = self.gw, self.sent, self.sent.candidate.estimate
        if outcome == "ok":
            sent.resp.release()
        else:
            sent.resp.close()
        sent.ticket.finish()
        t = gw.telemetry
        t.count_request(sent.state.id, self.plan.request.model, self.plan.decision.policy, est.regime.value, outcome)
        if outcome == "ok":
            if sent.resp.status < 400:
                gw.backends.succeeded(sent.state)  # a complete answer: its consecutive failures start again
            _observe(gw, self.plan, sent, self.observer)
        else:
            sent.state.prefill_feed.ended_otherwise(sent.timing.sequence, gw.clock())
            gw.backends.scrape_soon(sent.state)
        self._log(outcome)

    def _log(self, outcome: str) -> None:
        if not self.gw.access_log.writes():
            return
        c, obs, status = self.sent.candidate, self.observer, self.sent.resp.status
        if self.sent.resp.headers.get("content-type", "").startswith("text/event-stream") or outcome == "ok":
            pass  # a stream that began is 200 (or the backend's status) whatever its end
        else:
            status = _ERROR_STATUS.get(outcome, status)
        self.gw.access_log.write(
            request_id=self.request_id, route=self.route, model=self.plan.request.model,
            backend=c.backend_id, status=status, outcome=outcome, cached_tokens=c.cached_tokens,
            uncached_prompt_tokens=c.uncached_prompt_tokens, kappa_ratio=c.estimate.kappa_ratio,
            regime=c.estimate.regime.value, ttft_s=obs.ttft_s, e2e_s=self.gw.clock() - obs.start_s,
            request_bytes=self.request_bytes, response_bytes=self.response_bytes,
            prefill_backend=self.sent.prefill_backend, **invalidation_fields(self._invalidation()))

    def _invalidation(self) -> Finding | None:
        """The request's prefix-invalidation finding (counted by then: `gateway.invalidation`)."""
        request = self.plan.request
        return self.gw.routing.invalidation(request) if isinstance(request, ParsedRequest) else None


class RelayedStream(StreamingResponse):
    """Starlette's streaming response, told of the client's leaving by the gateway's own server.

    Under ASGI 2.3 (uvicorn's) Starlette runs each stream in an anyio task group beside a task
    that reads ASGI messages until ``http.disconnect``. Under the gateway's edge protocol the
    connection tells the request instead (`gateway.edge.scope.CLIENT_GONE`): its future
    cancels the stream from a done callback, and the stream's generator is closed, so the
    relay settles ``client_disconnect`` as before, with no task group or second task per
    stream. Elsewhere it is Starlette's response unchanged.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = scope.get(CLIENT_GONE)
        task = asyncio.current_task()
        if client_gone is None or task is None:
            await super().__call__(scope, receive, send)
            return
        gone: asyncio.Future[None] = client_gone()
        state = {"finished": False, "fired": False}

        def interrupt(future: asyncio.Future[None]) -> None:
            if not state["finished"] and not future.cancelled():
                state["fired"] = True
                task.cancel()

        gone.add_done_callback(interrupt)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["fired"] or task.cancelling() > 1:
                raise  # not (only) the client's leaving: a cancellation from outside
            task.uncancel()
        finally:
            state["finished"] = True
            gone.remove_done_callback(interrupt)
            gone.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# The status a non-streamed request's client gets when the relay ends it (gateway.errors).
_ERROR_STATUS = {"upstream_timeout": 504, "upstream_error": 502, "shutdown": 503, "client_disconnect": 499}


def _observe(gw: GatewayState, plan: Plan, sent: FirstByte, obs: SseObserver) -> None:
    """The figures of a complete answer: latencies, κ, tokens by source, the κ_crit fit, usage."""
    c, state = sent.candidate, sent.state
    series = gw.telemetry.backend(state.id)
    timing = sent.timing
    series.response_headers[timing.stream].observe(timing.headers_s - obs.start_s)
    if obs.ttft_s is not None:  # streams only: a non-streamed body has no first-token time
        series.ttft.observe(obs.ttft_s)
    # A split request's decode phase ran no prefill here (its "prefill" is the KV pull): not fed (−1).
    if state.prefill_feed.completed_request(-1 if sent.split else timing.sequence, obs.usage, gw.clock()):
        gw.backends.scrape_soon(state)
    for gap in obs.itl_s:
        series.itl.observe(gap)
    series.e2e.observe(gw.clock() - obs.start_s)
    series.kappa_ratio.observe(c.estimate.kappa_ratio)
    series.kappa_ratio_loaded.observe(c.estimate.kappa_ratio_loaded)
    series.cached_hbm_tokens.inc(c.cached_hbm_tokens)
    series.cached_host_tokens.inc(c.cached_host_tokens)
    if c.cached_kv_pool_tokens:
        series.cached_kv_pool_tokens.inc(c.cached_kv_pool_tokens)
    series.uncached_prompt_tokens.inc(c.uncached_prompt_tokens)
    if obs.usage:
        stale = gw.routing.observe_usage(plan, c, obs.usage, evidence=not sent.split)
        if stale:  # the index's credit was contradicted again and again: forget, off the request path
            gw.spawn(gw.routing.forget_stale(stale, plan, state))
