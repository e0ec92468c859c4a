"""The prefill phase of a split request (P/D), as vLLM's disaggregated serving runs it.

vLLM's NixlConnector flow (its proxy example, ``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``): the prefill instance gets the client's body with
``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null,
remote_block_ids: null, remote_host: null, remote_port: null}``, ``stream: false``,
``max_tokens: 1`` (and ``max_completion_tokens: 1`` where the client set it), no
``stream_options``, and without ``min_tokens`` / ``min_completion_tokens`` (which a one-token
request cannot honour). It prefills, keeps the KV, and answers with the ``kv_transfer_params`` a
decode instance needs to pull it (its engine id, block ids, host and port). The decode instance
then gets the client's own body plus those params, pulls the blocks it lacks and decodes: its
response is the one the client gets (streamed or not, its usage and ``cached_tokens``).

Guarantees, as for an aggregated request (`gateway.proxy.attempts`):

- the prefill phase runs under the request's one first-byte deadline and watches the client: a
  client that leaves cancels it (the prefill instance aborts the request, freeing its KV) and no
  decode phase is sent; it also watches the prefill backend: one that leaves rotation (failed
  health checks, an ejection; a SIGSTOPped instance) ends the phase at once, a failure like any
  other (the decode backend is always left to fall back to), instead of holding the request until
  the deadline;
- a prefill phase that fails (no connection, reset, 5xx, a timeout, a 4xx, or an answer without
  ``kv_transfer_params``: an instance without a connector) is counted against the prefill backend
  (its outlier ejection, as any upstream failure) and the request goes **whole** to the decode
  backend, which prefills it locally (any vLLM instance serves a request without
  ``kv_transfer_params``): a fallback to aggregated, counted in ``gateway_pd_prefill_fallbacks_total``;
- the decode phase is the first attempt of `first_byte` (`SplitAttempt`); a failure there before
  the first byte is retried whole on the next backend of the ranking.

Each phase carries its own ``X-Request-Id`` (``<id>-<hex>``, `gateway.upstream.request`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import CIMultiDict

from dispatch import Ticket
from gateway.backends.backend_state import BackendState
from gateway.errors import UpstreamError, UpstreamStatus
from gateway.proxy.attempts import ClientWatch, SplitAttempt, account_failure, first_of
from gateway.routing import RoutePlan
from gateway.state import GatewayState
from gateway.upstream.errors import Phase, mapped_errors
from gateway.upstream.request import Bound, attempt_request_id, open_response

log = logging.getLogger("kappa_gateway.proxy")

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None}
"""What a proxy asks a vLLM prefill instance for (vLLM's toy proxy, NixlConnector)."""


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill phase's body: the client's, asking for one token, not streamed, KV kept (module docstring)."""
    out = dict(body)
    out["kv_transfer_params"] = PREFILL_KV_TRANSFER_PARAMS
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return orjson.dumps(out)


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    """The decode phase's body: the client's own, with the prefill's ``kv_transfer_params``."""
    return orjson.dumps({**body, "kv_transfer_params": kv_transfer_params})


@dataclass(slots=True)
class PrefillDone:
    """A prefill phase that succeeded: where, its ticket (held until the decode has pulled the KV),
    and the decode phase to send."""

    state: BackendState
    ticket: Ticket
    decode: SplitAttempt


class PrefillFailed(Exception):
    """The prefill phase failed in a way the decode backend can make up for (module docstring)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


async def run_prefill(gw: GatewayState, plan: RoutePlan, raw: bytes, headers: CIMultiDict[str], watch: ClientWatch, *,
                      path: str, deadline_s: float, request_id: str) -> PrefillDone | None:
    """Run a split plan's prefill phase (``plan.decision.prefill``).

    Returns:
        The phase done (then send ``decode``), or ``None``: it failed, both tickets are released,
        and the caller sends the request whole (aggregated) down ``plan.decision.ranked``.

    Raises:
        ClientGone: the client left (both tickets released; nothing more is sent).
        ShuttingDown: the grace period ended first (likewise).
    """
    leg = plan.decision.prefill
    assert leg is not None
    body = orjson.loads(raw)  # valid: it was parsed to route it
    state = plan.targets[leg.candidate.backend_id]
    prefill_ticket, decode_ticket = gw.routing.dispatcher.charge_split(plan)
    pd = gw.telemetry.pd
    sent_s = gw.clock()
    try:
        params = await _prefill(gw, state, prefill_body(body), headers, watch, path=path, deadline_s=deadline_s,
                                request_id=request_id)
    except PrefillFailed as failed:
        prefill_ticket.finish()
        decode_ticket.finish()
        pd.prefill_fallbacks.labels(state.id, failed.reason).inc()
        log.warning("request %s: prefill on %s failed (%s), sending it whole to %s: %s", request_id, state.id,
                    failed.reason, plan.decision.chosen.backend_id, failed)
        return None
    except BaseException:
        prefill_ticket.finish()
        decode_ticket.finish()
        raise
    prefill_ticket.first_byte()  # its prefill is done; its KV stays held until the decode has pulled it
    pd.prefill_seconds.labels(state.id).observe(gw.clock() - sent_s)
    pd.splits.labels(state.id, plan.decision.chosen.backend_id).inc()
    if gw.routing.dispatcher.records_anything(plan.request.hashes, "backend"):
        gw.spawn(gw.routing.record(plan.request.model, state, list(plan.request.hashes), holders="backend"))
    return PrefillDone(state, prefill_ticket, SplitAttempt(decode_body(body, params), decode_ticket, state.id))


async def _prefill(gw: GatewayState, state: BackendState, payload: bytes, headers: CIMultiDict[str],
                   watch: ClientWatch, *, path: str, deadline_s: float, request_id: str) -> dict[str, Any]:
    """Send the prefill phase and return the ``kv_transfer_params`` of its answer.

    Raises:
        PrefillFailed: no usable answer (the failure counted against the backend where it is its own).
        ClientGone, ShuttingDown: as `run_prefill`.
    """
    g = gw.settings.gateway
    remaining_s = deadline_s - gw.clock()
    if remaining_s <= 0:
        raise PrefillFailed("timeout", "the request's first-byte deadline had passed")
    idle_s = g.upstream_idle_timeout_s
    up_headers = headers.copy()
    up_headers["X-Request-Id"] = attempt_request_id(request_id)
    up_headers["Content-Type"] = "application/json"
    whole = Bound(min(remaining_s, g.upstream_per_try_timeout_s or remaining_s), idle=False)
    attempt = asyncio.ensure_future(open_response(gw.session, state.entry.url + path, payload, up_headers,
                                                  headers_bound=whole, first_byte_bound=Bound(idle_s, idle=True),
                                                  clock=gw.clock))
    # The decode backend is always left to fall back to: a prefill backend leaving rotation (a SIGSTOPped
    # one fails its health checks) ends the phase then, not at the deadline, as `first_byte` moves an attempt.
    down = gw.backends.down_signal(state)
    try:
        resp, first, _ = await first_of(attempt, watch.signal, down, gw.stopping_signal(), state.id)
    except UpstreamError as exc:
        account_failure(gw, state, exc)
        raise PrefillFailed(exc.retry_kind, exc.message) from exc
    try:
        chunks = [first]
        async with asyncio.timeout(idle_s):
            with mapped_errors(Phase.BODY, state.id):
                while chunk := await resp.content.readany():
                    chunks.append(chunk)
    except (UpstreamError, TimeoutError) as exc:
        resp.close()
        error = exc if isinstance(exc, UpstreamError) else UpstreamStatus("silent mid-body", upstream_status=504)
        account_failure(gw, state, error)
        raise PrefillFailed("timeout" if isinstance(exc, TimeoutError) else error.retry_kind, str(exc)) from exc
    resp.release()
    answer = b"".join(chunks)
    if resp.status >= 400:
        raise PrefillFailed("4xx" if resp.status < 500 else "5xx",
                            f"answered {resp.status}: {answer[:300].decode('utf-8', 'replace')}")
    try:
        params = orjson.loads(answer).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        params = None
    if not isinstance(params, dict) or not params:
        raise PrefillFailed("no-kv-transfer-params", "its answer carries no kv_transfer_params (is vLLM running "
                            "with a KV connector, --kv-transfer-config, kv_role kv_producer or kv_both?)")
    gw.backends.succeeded(state)
    return params
