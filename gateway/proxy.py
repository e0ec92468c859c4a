"""The proxy path of one OpenAI request: read, route, send (retrying once before the first byte), relay.

DESIGN.md §1 steps 5–6. The body goes upstream byte for byte as the client sent it;
streams come back as they arrive; the response carries the routing headers
(``x-kappa-backend``, ``x-kappa-ratio``, ``x-kappa-crit``, ``x-kappa-regime``,
``x-request-id``). A connect error, timeout or 5xx before the first byte is retried once
on the next-best backend; after the first byte, never. A client that disconnects closes
the upstream response (its request is aborted there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.errors import GatewayError, PayloadTooLarge, UpstreamError, UpstreamUnavailable
from gateway.relay import SseObserver, midstream_error_event, usage_from_body
from gateway.routing import Kind, RoutePlan
from gateway.state import GatewayState
from gateway.upstream import forward_headers, open_response, response_headers
from router.types import Candidate

log = logging.getLogger("kappa_gateway.proxy")

RETRIES_BEFORE_FIRST_BYTE = 1
UPSTREAM_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole request body, refusing more than ``limit_bytes``. Raises PayloadTooLarge."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit_bytes} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def kappa_headers(candidate: Candidate, request_id: str) -> dict[str, str]:
    est = candidate.estimate
    crit = "inf" if math.isinf(est.kappa_crossover) else f"{est.kappa_crossover:.4g}"
    return {"x-kappa-backend": candidate.backend_id, "x-kappa-ratio": f"{est.kappa_ratio:.4g}",
            "x-kappa-crit": crit, "x-kappa-regime": est.regime.value, "x-request-id": request_id}


async def proxy(request: Request, kind: Kind, gw: GatewayState) -> Response:
    """Serve one chat or completions request end to end.

    Raises:
        GatewayError: the gateway's own refusals and upstream failures, carrying the request id
            (the app's handler answers them OpenAI-style with ``x-request-id``); each is counted in
            ``gateway_requests_total`` with backend "none" and its HTTP status.
    """
    received_s = gw.clock()
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        return await _proxy(request, kind, gw, received_s, request_id)
    except GatewayError as exc:
        exc.request_id = request_id
        gw.telemetry.count_request("none", "none", gw.settings.routing.policy, "none", str(exc.status))
        raise


async def _proxy(request: Request, kind: Kind, gw: GatewayState, received_s: float, request_id: str) -> Response:
    raw = await read_body(request, gw.settings.gateway.max_body_bytes)
    parsed = gw.routing.parse(kind, raw)
    plan = await gw.routing.plan(parsed)
    up_headers = forward_headers(request.headers, request_id)
    last_error: UpstreamError | None = None
    for candidate in plan.decision.ranked[: 1 + RETRIES_BEFORE_FIRST_BYTE]:
        state = plan.targets[candidate.backend_id]
        idle = state.ledger.in_flight == 0  # a clean sample for the κ_crit fit if nothing else ran there
        ticket = gw.routing.charge(plan, candidate)
        try:
            resp, first = await open_response(
                gw.session, state.entry.url + UPSTREAM_PATHS[kind], raw, up_headers,
                first_byte_timeout_s=gw.settings.gateway.upstream_first_byte_timeout_s)
        except BaseException as exc:
            ticket.finish()  # the ledger and the pending chain are released on every path
            if not isinstance(exc, UpstreamError):
                raise
            gw.telemetry.retries.labels(state.id).inc()
            if isinstance(exc, UpstreamUnavailable):
                gw.backends.mark_down(state, exc.message)
            log.warning("request %s: %s failed before the first byte: %s", request_id, state.id, exc.message)
            last_error = exc
            continue
        ticket.first_byte()
        if resp.status < 400:  # the backend ran the prefill: its cache now holds the chain
            gw.spawn(gw.routing.record(parsed.model, state, parsed.hashes))
        relay = _Relay(gw, plan, candidate, ticket, resp, received_s, idle)
        headers = {**response_headers(resp.headers), **kappa_headers(candidate, request_id)}
        if resp.status < 400 and _is_event_stream(resp):
            return StreamingResponse(relay.stream(first), status_code=resp.status, headers=headers)
        body = await relay.body(request, first)
        return Response(body, status_code=resp.status, headers=headers)
    assert last_error is not None
    raise last_error


def _is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.headers.get("content-type", "").startswith("text/event-stream")


class _Relay:
    """Relays one upstream response and settles its ticket, metrics and usage exactly once."""

    def __init__(self, gw: GatewayState, plan: RoutePlan, candidate: Candidate, ticket, resp: aiohttp.ClientResponse,
                 received_s: float, backend_idle: bool) -> None:
        self.gw, self.plan, self.candidate, self.ticket, self.resp = gw, plan, candidate, ticket, resp
        self.observer = SseObserver(received_s)
        self.backend_idle = backend_idle

    async def stream(self, first: bytes) -> AsyncIterator[bytes]:
        gw, resp, idle = self.gw, self.resp, self.gw.settings.gateway.upstream_idle_timeout_s
        outcome = "client_disconnect"
        try:
            self.observer.feed(first, gw.clock())
            yield first
            while True:
                try:
                    async with asyncio.timeout(idle):
                        chunk = await resp.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcome = "upstream_error"
                    log.warning("backend %s failed mid-stream: %r", self.candidate.backend_id, exc)
                    yield midstream_error_event(f"backend {self.candidate.backend_id} failed mid-stream: "
                                                f"{exc.__class__.__name__}")
                    return
                if not chunk:
                    break
                self.observer.feed(chunk, gw.clock())
                yield chunk
            outcome = "ok"
        finally:
            self._settle(outcome)

    async def body(self, request: Request, first: bytes) -> bytes:
        """Read a non-streamed body; a client that disconnects first aborts the upstream request."""
        if self.resp.content.at_eof():  # the whole body came with the first bytes: nothing to wait for
            return self._body_read(first)

        async def rest() -> bytes:
            return first + await self.resp.read() if first else await self.resp.read()

        read = asyncio.ensure_future(rest())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                self._settle("client_disconnect")
                return b""
            body = read.result()
        except aiohttp.ClientError as exc:
            self._settle("upstream_error")
            raise UpstreamUnavailable(f"backend {self.candidate.backend_id} failed while sending its response: {exc}") from exc
        finally:
            gone.cancel()
        return self._body_read(body)

    def _body_read(self, body: bytes) -> bytes:
        usage = usage_from_body(body) if self.resp.status < 400 else None
        if usage:
            self.observer.usage = usage
        self._settle("ok" if self.resp.status < 400 else f"upstream_{self.resp.status // 100}xx")
        return body

    def _settle(self, outcome: str) -> None:
        if self.ticket is None:
            return
        gw, backend, est = self.gw, self.candidate.backend_id, self.candidate.estimate
        if outcome == "ok":
            self.resp.release()
        else:
            self.resp.close()
        self.ticket.finish()
        self.ticket = None
        now = gw.clock()
        t = gw.telemetry
        t.count_request(backend, self.plan.request.model, self.plan.decision.policy, est.regime.value, outcome)
        if outcome != "ok":
            return
        obs = self.observer
        c = self.candidate
        series = t.backend(backend)
        if obs.ttft_s is not None:  # streams only: a non-streamed body has no first-token time
            series.ttft.observe(obs.ttft_s)
            fit = self.plan.targets[backend].kappa_fit
            if not c.cached_kv_pool_tokens:  # the fit is of the host link; pool loads run at another rate
                fit.observe(uncached_prompt_tokens=c.uncached_prompt_tokens, cached_host_tokens=c.cached_host_tokens, ttft_s=obs.ttft_s,
                            backend_idle=self.backend_idle)
            measured = fit.kappa_crit()
            if measured is not None:
                t.kappa_crit.labels(backend, "measured").set(measured)
        for gap in obs.itl_s:
            series.itl.observe(gap)
        series.e2e.observe(now - obs.start_s)
        series.kappa_ratio.observe(est.kappa_ratio)
        series.cached_hbm_tokens.inc(c.cached_hbm_tokens)
        series.cached_host_tokens.inc(c.cached_host_tokens)
        if c.cached_kv_pool_tokens:
            series.cached_kv_pool_tokens.inc(c.cached_kv_pool_tokens)
        series.uncached_prompt_tokens.inc(c.uncached_prompt_tokens)
        if obs.usage:
            gw.routing.observe_usage(self.plan, c, obs.usage)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
