"""The proxy path of one OpenAI request: check, admit, read, route, get a first byte, relay.

DESIGN.md §1 steps 5–6. A request first passes the client-key check (`gateway.edge.auth`) and
admission (`gateway.edge.admission`: requests and body bytes held at once), then its body is read
(`gateway.edge.body`: size limit, ``Content-Encoding``). The body goes upstream as the client sent
it (decoded if it was compressed; each attempt with its own ``X-Request-Id``, the client's
address appended to ``X-Forwarded-For``); streams come back as they arrive; the response
carries the routing headers (``x-kappa-backend``, ``x-kappa-ratio``, ``x-kappa-ratio-loaded``,
``x-kappa-crit``, ``x-kappa-regime`` (`kappa_headers`), ``x-request-id``: the client's own id
when it is a safe token, else the gateway's; a split request's also ``x-kappa-prefill-backend``,
the backend that prefilled it: `gateway.proxy.disagg`). Attempts, the one deadline and retries:
`gateway.proxy.attempts`; the relay after the first byte and the bookkeeping: `gateway.proxy.relay`.
A chat body's prefix-invalidation finding is computed in a loop callback once it is routed, so that
it runs while the request is on its way upstream, not before (`gateway.invalidation`).
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Literal

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.edge.access_log import invalidation_fields
from gateway.edge.admission import Slot
from gateway.edge.answers import error_response
from gateway.proxy.attempts import ClientWatch, first_byte
from gateway.proxy.disagg import PrefillDone, run_prefill
from gateway.edge.body import read_body
from gateway.errors import ClientGone, GatewayError
from gateway.proxy.relay import Relay, RelayedStream
from gateway.edge.request_ids import new_request_id
from gateway.routing import Kind, RoutePlan
from router import kappa
from gateway.state import GatewayState
from gateway.upstream.request import forward_headers, response_headers
from router.types import Candidate

UPSTREAM_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned (never seen by the client)
# A client's X-Request-Id is kept when it is a short token of safe characters (it is echoed in
# a header and logged); anything else is replaced by the gateway's own id.
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id_of(value: str | None) -> str:
    """The request's id: the client's ``X-Request-Id`` when safe (`_SAFE_REQUEST_ID`), else a new one
    (`gateway.edge.request_ids.new_request_id`: 32 hex characters)."""
    if value is not None and _SAFE_REQUEST_ID.fullmatch(value):
        return value
    return new_request_id()


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


async def serve_proxy(scope: Scope, receive: Receive, send: Send, kind: Kind, gw: GatewayState) -> None:
    """Serve one chat or completions request as an ASGI call, holding its admission slot
    until the last byte of the answer is sent (a stream: until it ends)."""
    request = Request(scope, receive, send)
    slot: Slot | None = None
    try:
        gw.keys.check_client(request.headers)
        slot = gw.admission.admit()
        response = await proxy(request, kind, gw, slot)
    except GatewayError as exc:
        if not exc.counted:  # refused before proxy() began: key or admission
            exc.request_id = request_id_of(request.headers.get("x-request-id"))
            _count_unrouted(gw, kind, exc.request_id, str(exc.status), exc.status, "refused")
            exc.counted = True
        response = error_response(exc)
    except Exception as exc:  # noqa: BLE001 -- every failure is answered, OpenAI-style
        response = error_response(exc)
    try:
        await response(scope, receive, send)
    finally:
        if slot is not None:
            slot.release()


def _transfer_bytes(plan: RoutePlan) -> float:
    """KV bytes a split request's decode pulled, as predicted: (P − K_d)·B_kv (`router.pd`)."""
    leg = plan.decision.prefill
    if leg is None:
        return 0.0
    return kappa.model_constants(plan.targets[plan.decision.chosen.backend_id].spec.model).kv_bytes(leg.transfer_tokens)


def _count_unrouted(gw: GatewayState, kind: Kind, request_id: str, label: str, status: int, outcome: str,
                    e2e_s: float | None = None) -> None:
    """Count and log a request that ended before any backend had it (backend "none")."""
    gw.telemetry.count_request("none", "none", gw.settings.routing.policy, "none", label)
    gw.access_log.write(request_id=request_id, route=kind, backend="none", status=status, outcome=outcome,
                        e2e_s=e2e_s)


async def proxy(request: Request, kind: Kind, gw: GatewayState, slot: Slot | None = None) -> Response:
    """Serve one chat or completions request end to end (the key and admission already passed).

    Raises:
        GatewayError: the gateway's own refusals and upstream failures, carrying the request id
            (answered OpenAI-style with ``x-request-id``); each is counted once in
            ``gateway_requests_total`` and the access log: with backend "none" and its HTTP
            status, unless the relay already counted it under its backend.
    """
    received_s = gw.clock()
    request_id = request_id_of(request.headers.get("x-request-id"))
    try:
        return await _proxy(request, kind, gw, received_s, request_id, slot)
    except GatewayError as exc:
        exc.request_id = request_id
        if not exc.counted:
            exc.counted = True
            _count_unrouted(gw, kind, request_id, str(exc.status), exc.status,
                            "refused" if exc.status < 500 else "failed", gw.clock() - received_s)
        raise
    except ClientDisconnect:  # the client left while sending its body: nobody reads an answer
        _count_unrouted(gw, kind, request_id, "client_disconnect", CLIENT_CLOSED_REQUEST, "client_disconnect",
                        gw.clock() - received_s)
        return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _proxy(request: Request, kind: Kind, gw: GatewayState, received_s: float, request_id: str,
                 slot: Slot | None) -> Response:
    raw = await read_body(request, gw.settings.gateway.max_body_bytes, slot)
    parsed = gw.routing.parse(kind, raw)
    plan = await gw.routing.plan(parsed)
    parsed = plan.request  # type: ignore[assignment]  # the same request, with token ids a long prompt got in `plan`
    if parsed.invalidation is not None:  # a chat body: counted once on its way upstream (gateway.invalidation)
        asyncio.get_running_loop().call_soon(gw.routing.invalidation, parsed)
    client = request.client
    up_headers = forward_headers(request.headers, client.host if client else None,
                                 authorization=gw.settings.gateway.forward_authorization)
    if "content-encoding" in request.headers:
        up_headers.popall("Content-Encoding", None)  # the body goes up decoded (gateway.edge.body)
    watch = ClientWatch(request)
    prefilled: PrefillDone | None = None
    if parsed.client_kv_transfer and gw.routing.pd_links is not None:  # a pull the links' check did not send
        gw.routing.pd_links.foreign_transfer(plan.decision.chosen.backend_id)
    try:
        if plan.decision.prefill is not None:  # P/D: the prefill phase first (gateway.proxy.disagg)
            prefilled = await run_prefill(gw, plan, raw, up_headers, watch, path=UPSTREAM_PATHS[kind], request_id=request_id,
                                          deadline_s=received_s + gw.settings.gateway.upstream_first_byte_timeout_s)
        try:
            sent = await first_byte(gw, plan, raw, up_headers, watch, path=UPSTREAM_PATHS[kind], received_s=received_s,
                                    request_id=request_id, stream=parsed.stream,
                                    split=prefilled.decode if prefilled is not None else None,
                                    own_kv_transfer=parsed.client_kv_transfer)
        finally:
            if prefilled is not None:  # the decode has pulled the KV (its first byte), or will never
                prefilled.ticket.finish()
        if sent.prefill_backend is not None and gw.routing.pd_links is not None:
            gw.routing.pd_links.transferred(sent.prefill_backend, sent.state.id, _transfer_bytes(plan))
        if slot is not None:
            slot.release_body()  # no retry can re-send it now
        resp = sent.resp
        # The backend ran the prefill: its cache (and the pool) hold the chain. With peers the backend
        # was recorded when the request was sent (gateway.replicas.peer_load): the pool now.
        holders: Literal["both", "kv_pool"] = "both" if gw.peers is None else "kv_pool"
        if resp.status < 400 and gw.routing.dispatcher.records_anything(parsed.hashes, holders):
            gw.spawn(gw.routing.record(parsed.model, sent.state, parsed.hashes, holders=holders,
                                       engine_hashes=parsed.engine_hashes, engine_block_tokens=parsed.engine_block_tokens))
        relay = Relay(gw, plan, sent, received_s, request_id=request_id, route=kind,
                      request_bytes=len(raw))
        headers = {**response_headers(resp.headers), **kappa_headers(sent.candidate, request_id)}
        if sent.prefill_backend is not None:
            headers["x-kappa-prefill-backend"] = sent.prefill_backend
        if resp.status < 400 and resp.headers.get("content-type", "").startswith("text/event-stream"):
            watch.stop()  # the streaming response listens for the client's disconnect itself
            return RelayedStream(relay.stream(), status_code=resp.status, headers=headers)
        body = await relay.body(watch)
        return Response(body, status_code=resp.status, headers=headers)
    except ClientGone as gone:
        if not gone.counted:
            gw.telemetry.count_request(gone.backend, parsed.model, plan.decision.policy, "none", "client_disconnect")
            gw.access_log.write(request_id=request_id, route=kind, model=parsed.model, backend=gone.backend,
                                status=CLIENT_CLOSED_REQUEST, outcome="client_disconnect",
                                e2e_s=gw.clock() - received_s, request_bytes=len(raw),
                                **invalidation_fields(gw.routing.invalidation(parsed)))
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: the client has gone
    finally:
        watch.stop()
