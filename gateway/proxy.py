"""The proxy path of one OpenAI request: read, route, get a first byte, relay.

DESIGN.md §1 steps 5–6. The body goes upstream byte for byte as the client sent it (each
attempt with its own ``X-Request-Id``, the client's address appended to ``X-Forwarded-For``);
streams come back as they arrive; the response carries the routing headers
(``x-kappa-backend``, ``x-kappa-ratio``, ``x-kappa-ratio-loaded``, ``x-kappa-crit``,
``x-kappa-regime`` (`kappa_headers`), ``x-request-id``: the client's own id, or the gateway's).
Attempts, the one deadline and retries: `gateway.attempts`; the relay after the first byte
and the bookkeeping: `gateway.relay`.
"""

from __future__ import annotations

import math
import uuid

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.attempts import ClientWatch, first_byte
from gateway.errors import ClientGone, GatewayError, PayloadTooLarge
from gateway.relay import Relay
from gateway.routing import Kind
from gateway.state import GatewayState
from gateway.upstream import forward_headers, response_headers
from router.types import Candidate

UPSTREAM_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned (never seen by the client)


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
    """The routing headers of a response: the chosen backend and its κ figures for this request.

    ``x-kappa-ratio`` = K/T (every cached token), ``x-kappa-ratio-loaded`` = K_loaded/T (host
    tier + KV pool: what must move), ``x-kappa-crit`` = this request's κ_crit there (at its T
    and K_hbm, over the link its loads cross; ``inf``: never transfer-bound), ``x-kappa-regime``
    = ``transfer`` iff ratio-loaded > crit. Names and definitions: `router.kappa`, `router.cost.CostEstimate`.
    Numbers carry 4 significant digits.
    """
    est = candidate.estimate
    crit = "inf" if math.isinf(est.kappa_crit) else f"{est.kappa_crit:.4g}"
    return {"x-kappa-backend": candidate.backend_id, "x-kappa-ratio": f"{est.kappa_ratio:.4g}",
            "x-kappa-ratio-loaded": f"{est.kappa_ratio_loaded:.4g}", "x-kappa-crit": crit,
            "x-kappa-regime": est.regime.value, "x-request-id": request_id}


async def proxy(request: Request, kind: Kind, gw: GatewayState) -> Response:
    """Serve one chat or completions request end to end.

    Raises:
        GatewayError: the gateway's own refusals and upstream failures, carrying the request id
            (the app's handler answers them OpenAI-style with ``x-request-id``); each is counted once in
            ``gateway_requests_total``: with backend "none" and its HTTP status, unless the relay
            already counted it under its backend.
    """
    received_s = gw.clock()
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        return await _proxy(request, kind, gw, received_s, request_id)
    except GatewayError as exc:
        exc.request_id = request_id
        if not exc.counted:
            gw.telemetry.count_request("none", "none", gw.settings.routing.policy, "none", str(exc.status))
        raise


async def _proxy(request: Request, kind: Kind, gw: GatewayState, received_s: float, request_id: str) -> Response:
    raw = await read_body(request, gw.settings.gateway.max_body_bytes)
    parsed = gw.routing.parse(kind, raw)
    plan = await gw.routing.plan(parsed)
    client = request.client
    up_headers = forward_headers(request.headers, client.host if client else None)
    watch = ClientWatch(request)
    try:
        sent = await first_byte(gw, plan, raw, up_headers, watch, path=UPSTREAM_PATHS[kind], received_s=received_s,
                                request_id=request_id, stream=parsed.stream)
        resp = sent.resp
        if resp.status < 400:  # the backend ran the prefill: its cache now holds the chain
            gw.spawn(gw.routing.record(parsed.model, sent.state, parsed.hashes))
        relay = Relay(gw, plan, sent, received_s)
        headers = {**response_headers(resp.headers), **kappa_headers(sent.candidate, request_id)}
        if resp.status < 400 and resp.headers.get("content-type", "").startswith("text/event-stream"):
            watch.stop()  # the streaming response listens for the client's disconnect itself
            return StreamingResponse(relay.stream(), status_code=resp.status, headers=headers)
        body = await relay.body(watch)
        return Response(body, status_code=resp.status, headers=headers)
    except ClientGone as gone:
        if not gone.counted:
            gw.telemetry.count_request(gone.backend, parsed.model, plan.decision.policy, "none", "client_disconnect")
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: the client has gone
    finally:
        watch.stop()
