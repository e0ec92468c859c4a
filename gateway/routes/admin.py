"""Operator routes: liveness, readiness, metrics, backend state and routing explanations.

``/v1/kappa/*`` needs the admin key when one is configured, and ``/metrics`` too when
``gateway.metrics_require_admin_key`` (`gateway.edge.auth`); ``/health`` and ``/ready`` stay open.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from gateway.errors import BadRequest
from gateway.edge.body import read_body
from gateway.edge.scope import CONNECTION_LOAD
from gateway.routes.deps import State, get_state
from gateway.routing import load_body
from gateway.backends.kappa_feed import measured_fields
from prefix_index import KV_POOL_ID, PrefixIndexError
from router import kappa
from router.cost import BackendSpec, RequestShape, predict
from router.decode import estimate_decode
from router.pd import price_split
from router.profiles import GB



async def require_admin_key(request: Request) -> None:
    """Raises Unauthorized (401) unless the admin key is unset or presented (counted in
    ``gateway_admin_unauthorized_total``: guesses at the key are visible)."""
    gw = await get_state(request)
    try:
        gw.keys.check_admin(request.headers)
    except Exception:
        gw.telemetry.admin_unauthorized.inc()
        raise


routes = APIRouter()
kappa_routes = APIRouter(prefix="/v1/kappa", dependencies=[Depends(require_admin_key)])


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


@routes.api_route("/health", methods=["GET", "HEAD"])
async def health() -> dict:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@routes.get("/ready")
async def ready(request: Request, gw: State) -> Response:
    """Readiness: started, not draining for shutdown, at least one backend healthy, and the proxy
    listener below its connection cap (``"saturated"``, when served by the edge protocol)."""
    load = request.scope.get(CONNECTION_LOAD)
    open_connections, cap = load() if load is not None else (0, 0)
    saturated = load is not None and open_connections >= cap
    ok = gw.ready and not gw.draining and gw.backends.any_healthy() and not saturated
    healthy = sum(s.healthy for s in gw.backends.states)
    body = {"ready": ok, "draining": gw.draining, "saturated": saturated, "healthy_backends": healthy,
            "backends": len(gw.backends.states)}
    if load is not None:
        body["client_connections"], body["max_client_connections"] = open_connections, cap
    if saturated:
        body["reason"] = f"{open_connections} client connections open, at the cap of {cap}: new ones get 503"
    return JSONResponse(body, status_code=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: Request, gw: State) -> Response:
    """Prometheus exposition; behind the admin key when ``gateway.metrics_require_admin_key``."""
    if gw.keys.metrics_protected:
        await require_admin_key(request)
    return Response(gw.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)


# T of the reference κ_crit figures `/v1/kappa/backends` shows per backend and link.
REFERENCE_UNCACHED_PROMPT_TOKENS = (128, 1024, 8192)


def kappa_crit_reference(spec: BackendSpec) -> dict[str, dict[str, float | None] | None]:
    """κ_crit of reference requests on one backend: T uncached tokens (the keys), no HBM hit,
    K_loaded = T from the host tier ("host") or from the KV pool ("kv_pool"; None without a
    pool link), by `router.cost.predict` (what the router computes for such a request). A
    value is None where no K makes such a request transfer-bound."""
    def at(t: int, *, host: int = 0, kv_pool: int = 0) -> float | None:
        return _finite(predict(RequestShape(0, host, t, 1, cached_kv_pool_tokens=kv_pool), spec).kappa_crit)

    ts = REFERENCE_UNCACHED_PROMPT_TOKENS
    return {"host": {str(t): at(t, host=t) for t in ts},
            "kv_pool": {str(t): at(t, kv_pool=t) for t in ts} if spec.kv_pool_link_bytes_per_s else None}


def _kv_events(gw: State, backend_id: str) -> dict[str, Any] | None:
    """A backend's KV-event mode (exact, degraded, approximate) and why, its stream position, the exact
    index's blocks by tier and its batches by outcome (`gateway.backends.kv_events_fleet.KvEventsFleet.view`)."""
    return None if gw.kv_events is None else gw.kv_events.view(backend_id)


@kappa_routes.get("/backends")
async def backends(gw: State) -> dict:
    """Per backend: health, κ figures, load, KV demand and capacity, indexed blocks; per model,
    whether it is in panic mode (``panic_mode``: its requests go to all its backends).

    Health: ``healthy`` (in rotation) and what decides it (`gateway.backends.rotation.Rotation.view`):
    the health checks' verdict, outlier ejection and its counters.

    κ figures (names: `router.kappa`): ``kappa_crit_linear`` (predicted, T-independent
    κ_M·κ_HW at the host link), ``kappa_crit_linear_routed``, ``kappa_crit_linear_measured`` and
    ``kappa_fit`` (measured, one factor per resource, and what routing uses: the fields below are its
    spec's; `gateway.backends.kappa_feed.measured_fields`), ``kappa_crit_reference``
    (`kappa_crit_reference`: the per-request κ_crit at reference T, by link).

    The decode batch the router prices (`router.decode`): ``decode_context_tokens`` and
    ``decode_output_tokens`` of the requests in flight (this replica's and its peers'), and
    ``foreign_requests``, those the last scrape found beyond them.

    P/D (issue 26): each backend's ``kv_role`` and ``node``; ``pd_links`` (null on an aggregated fleet), one
    entry per link from a backend that prefills to one that decodes: its configured figures, ``state``
    (healthy, degraded, broken: `gateway.backends.pd_links`), why, whether a probe is under way, and the
    bandwidth it was measured to deliver. ``kv_events``: its KV-event mode and exact index (`_kv_events`)."""
    try:
        index_blocks: dict[str, int] | None = (await gw.index.stats()).blocks_by_backend
    except PrefixIndexError:
        index_blocks = None
    out = []
    for s in gw.backends.states:
        spec, m = s.spec, s.metrics
        out.append({
            "id": s.id, "url": s.entry.url, "model": s.entry.model, "hardware": s.entry.hardware,
            "labels": s.entry.labels, "kv_role": s.entry.kv_role, "node": s.entry.node,
            "healthy": s.healthy, **gw.backends.rotation.view(s), "kv_events": _kv_events(gw, s.id),
            "power_cap_w": s.entry.power_cap_w, "tensor_parallel": s.entry.tensor_parallel,
            **measured_fields(s, gw.routing.pd_links),
            "kappa_crit_reference": kappa_crit_reference(spec),
            "kappa_hw": spec.kappa_hw,
            "b_kv_bytes": kappa.b_kv_bytes(spec.model),
            "c_eff_flops_per_s": spec.c_eff_flops_per_s, "link_bytes_per_s": spec.link_bytes_per_s,
            "kv_pool_link_bytes_per_s": spec.kv_pool_link_bytes_per_s or None,
            "in_flight": s.ledger.in_flight, "kv_demand_bytes": s.ledger.kv_demand_bytes,
            "peer_in_flight": s.ledger.peer_in_flight, "peer_kv_demand_bytes": s.ledger.peer_kv_demand_bytes,
            "peer_outstanding_prefill_s": s.ledger.peer_outstanding_prefill_s,
            "kv_capacity_bytes": s.kv_capacity_bytes, "host_tier_bytes": s.host_tier_bytes,
            "outstanding_prefill_s": s.ledger.outstanding_prefill_s,
            "decode_context_tokens": s.ledger.total_context_tokens, "decode_output_tokens": s.ledger.total_output_tokens,
            "foreign_requests": s.foreign_requests,
            "num_requests_waiting": m.num_requests_waiting, "num_requests_running": m.num_requests_running,
            "kv_cache_usage_ratio": m.kv_cache_usage_ratio,
            "cached_blocks": None if index_blocks is None else index_blocks.get(s.id, 0),
        })
    section = gw.settings.kv_pool
    kv_pool = None if section is None else {
        "capacity_bytes": section.capacity_gb * GB,
        "cached_blocks": None if index_blocks is None else index_blocks.get(KV_POOL_ID, 0),
    }
    peers = None if gw.peers is None else {"replica_id": gw.peers.id, "replicas_seen": gw.peers.replicas_seen,
                                           "sync_interval_s": gw.peers.interval_s}
    return {"backends": out, "policy": gw.settings.routing.policy, "index": gw.settings.index.backend,
            "kv_pool": kv_pool, "peers": peers, "panic_mode": dict(gw.backends.rotation.panic),
            "pd_links": None if gw.routing.pd_links is None else [r.as_dict() for r in gw.routing.pd_links.links.values()]}


@kappa_routes.post("/route")
async def explain(request: Request, gw: State) -> dict[str, Any]:
    """Explain the decision for a chat or completions body without sending it.

    Per candidate, the figures the response headers would carry had it been chosen
    (`router.cost.CostEstimate`): ``kappa_ratio`` (K/T), ``kappa_ratio_loaded`` (K_loaded/T,
    host tier + pool), ``kappa_crit`` (this request's κ_crit there: at its T and K_hbm, over
    the link its loads cross; null where no K makes it transfer-bound) and ``regime``
    (transfer iff kappa_ratio_loaded > kappa_crit); ``kappa_crit_linear`` is the backend's
    T-independent figure, for comparison. The decode in the batch each backend holds
    (`router.decode.DecodeEstimate`, whatever the policy): ``predicted_itl_s`` (seconds per output
    token with this request in the batch), ``predicted_decode_s``, ``predicted_e2e_s`` (TTFT +
    decode), ``predicted_interference_s`` (the seconds it would add to the E2E of the requests
    already there) and ``decode_batch_requests``. ``load_only_reason`` is null, or why the body would be
    routed on load alone, without prefix hashes (`gateway.routing`: e.g. ``nesting_too_deep``).
    ``invalidation`` (chat bodies; null otherwise) is the body's prefix-invalidation finding against the
    conversations the gateway has seen (`prefix_index.Finding.as_dict`): ``cause`` (null: append-only or
    no earlier conversation; else front_truncation, compaction, edit or reorder), ``invalidated_tokens``
    (the earlier request's tokens it would prefill again; ``invalidated_bytes``, their canonical bytes), ``conversation`` (which earlier conversation,
    an id of this process), ``earlier_messages``, ``common_prefix_messages``, ``messages``. Explaining
    records nothing: the finding a real request would get is unchanged. ``split`` (P/D fleets; null when
    the request would go whole to ``chosen``): the prefill backend and its figures for the request, the
    transfer (``transfer_tokens`` = P − K_d, ``transfer_s``, the ``link``) and the split's predicted TTFT,
    decode, E2E, work and interference (`router.pd`); ``chosen`` is then the decode backend, and ``reason``
    compares the split's score with the best aggregated one."""
    slot = gw.admission.admit()
    try:
        raw = await read_body(request, gw.settings.gateway.max_body_bytes, slot)
        return await _explain(raw, gw)
    finally:
        slot.release()


async def _explain(raw: bytes | bytearray, gw: State) -> dict[str, Any]:
    body = load_body(raw)
    if isinstance(body, dict) and "messages" in body:
        kind = "chat"
    elif isinstance(body, dict) and "prompt" in body:
        kind = "completion"
    elif isinstance(body, dict):
        raise BadRequest("The body needs 'messages' (chat) or 'prompt' (completions).")
    else:
        kind = "chat"  # parse_loaded() answers that the body must be a JSON object
    parsed = gw.routing.parse_loaded(kind, body, len(raw))
    plan = await gw.routing.plan(parsed, dry_run=True)
    finding = gw.routing.invalidation(parsed, dry_run=True)
    rank = {c.backend_id: i for i, c in enumerate(plan.decision.ranked)}
    views = {v.backend_id: v for v in plan.views}
    candidates = []
    for c in sorted(plan.decision.ranked, key=lambda c: rank[c.backend_id]):
        est = c.estimate
        decode = estimate_decode(plan.features, est, views[c.backend_id])
        candidates.append({
            "backend": c.backend_id, "rank": rank[c.backend_id],
            "hardware": plan.targets[c.backend_id].entry.hardware,
            "cached_hbm_tokens": c.cached_hbm_tokens, "cached_host_tokens": c.cached_host_tokens,
            "cached_kv_pool_tokens": c.cached_kv_pool_tokens,
            "uncached_prompt_tokens": c.uncached_prompt_tokens, "kappa_ratio": est.kappa_ratio,
            "kappa_ratio_loaded": est.kappa_ratio_loaded, "kappa_crit": _finite(est.kappa_crit),
            "kappa_crit_linear": plan.targets[c.backend_id].spec.kappa_crit_linear,
            "regime": est.regime.value, "admitted": c.admitted,
            "predicted_ttft_s": est.ttft_s, "predicted_prefill_s": est.prefill_s,
            "predicted_itl_s": decode.itl_s, "predicted_decode_s": decode.decode_s, "predicted_e2e_s": decode.e2e_s,
            "predicted_interference_s": decode.interference_s, "decode_batch_requests": decode.batch_requests,
            "t_compute_s": est.t_compute_s, "t_load_s": est.t_load_s,
            "predicted_energy_j": est.energy_j, "kv_demand_bytes": est.kv_demand_bytes,
        })
    f = plan.features
    split = None if plan.decision.prefill is None else _split(plan, views)
    return {
        "model": f.model, "kind": kind, "policy": plan.decision.policy, "chosen": plan.decision.chosen.backend_id,
        "reason": plan.decision.reason, "index_available": plan.index_ok,
        "load_only_reason": parsed.load_only_reason,
        "invalidation": None if finding is None else finding.as_dict(),
        "prompt_tokens_estimate": f.prompt_tokens, "prompt_blocks": f.prompt_blocks,
        "tokens_per_block_estimate": f.block_size_tokens, "max_tokens": f.max_tokens, "n": f.sequences,
        "candidates": candidates, "split": split,
    }


def _split(plan: Any, views: dict[str, Any]) -> dict[str, Any]:
    """A split decision's terms (`router.pd.SplitEstimate`): where it prefills and decodes, the transfer
    over the link between them, and the predicted TTFT, decode, work and interference."""
    leg, chosen = plan.decision.prefill, plan.decision.chosen
    p_view, d_view = views[leg.candidate.backend_id], views[chosen.backend_id]
    roles = plan.targets[leg.candidate.backend_id].entry.kv_role
    stalled = 0 if roles == "prefill" else p_view.in_flight + p_view.foreign_requests
    decode = estimate_decode(plan.features, chosen.estimate, d_view)
    est = price_split(plan.features, leg.candidate, stalled, chosen, d_view.spec, decode, leg.link)
    p_est = leg.candidate.estimate
    return {
        "prefill_backend": leg.candidate.backend_id, "decode_backend": chosen.backend_id,
        "prefill": {"cached_tokens": leg.candidate.cached_tokens, "uncached_prompt_tokens": leg.candidate.uncached_prompt_tokens,
                    "kappa_ratio": p_est.kappa_ratio, "regime": p_est.regime.value,
                    "predicted_ttft_s": p_est.ttft_s, "predicted_prefill_s": p_est.prefill_s},
        "transfer_tokens": leg.transfer_tokens, "transfer_s": leg.transfer_s,
        "link": {"kind": leg.link.kind.value, "bandwidth_bytes_per_s": leg.link.bandwidth_bytes_per_s,
                 "latency_s": leg.link.latency_s},
        "predicted_ttft_s": est.ttft_s, "predicted_decode_s": est.decode_s, "predicted_e2e_s": est.e2e_s,
        "predicted_work_s": est.work_s, "predicted_interference_s": est.interference_s,
    }
