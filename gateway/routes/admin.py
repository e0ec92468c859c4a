"""Operator routes: liveness, readiness, metrics, backend state and routing explanations."""

from __future__ import annotations

import math
from typing import Any

import orjson

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.errors import BadRequest
from gateway.kappa_feed import measured_fields
from gateway.proxy import read_body
from gateway.routes.deps import State
from prefix_index import KV_POOL_ID, PrefixIndexError
from router import kappa
from router.profiles import GB

router = APIRouter()


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


@router.api_route("/health", methods=["GET", "HEAD"])
async def health() -> dict:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(gw: State) -> Response:
    """Readiness: started, not draining for shutdown, and at least one backend healthy."""
    ok = gw.ready and not gw.draining and gw.backends.any_healthy()
    healthy = sum(s.healthy for s in gw.backends.states)
    return JSONResponse({"ready": ok, "draining": gw.draining, "healthy_backends": healthy,
                         "backends": len(gw.backends.states)}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(gw: State) -> Response:
    return Response(generate_latest(gw.telemetry.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/kappa/backends")
async def backends(gw: State) -> dict:
    """Per backend: health, κ figures, load, KV demand and capacity, indexed blocks."""
    try:
        index_blocks: dict[str, int] | None = (await gw.index.stats()).blocks_by_backend
    except PrefixIndexError:
        index_blocks = None
    out = []
    for s in gw.backends.states:
        spec, m = s.spec, s.metrics
        out.append({
            "id": s.id, "url": s.entry.url, "model": s.entry.model, "hardware": s.entry.hardware,
            "labels": s.entry.labels, "healthy": s.healthy,
            "power_cap_w": s.entry.power_cap_w, "tensor_parallel": s.entry.tensor_parallel,
            "kappa_crit": spec.kappa_crit_linear, **measured_fields(s),
            "kappa_hw": spec.kappa_hw,
            "b_kv_bytes": kappa.b_kv_bytes(spec.model),
            "c_eff_flops_per_s": spec.c_eff_flops_per_s, "link_bytes_per_s": spec.link_bytes_per_s,
            "kv_pool_link_bytes_per_s": spec.kv_pool_link_bytes_per_s or None,
            "in_flight": s.ledger.in_flight, "kv_demand_bytes": s.ledger.kv_demand_bytes,
            "kv_capacity_bytes": s.kv_capacity_bytes, "host_tier_bytes": s.host_tier_bytes,
            "outstanding_prefill_s": s.ledger.outstanding_prefill_s,
            "num_requests_waiting": m.num_requests_waiting, "num_requests_running": m.num_requests_running,
            "kv_cache_usage_ratio": m.kv_cache_usage_ratio,
            "cached_blocks": None if index_blocks is None else index_blocks.get(s.id, 0),
        })
    section = gw.settings.kv_pool
    kv_pool = None if section is None else {
        "capacity_bytes": section.capacity_gb * GB,
        "cached_blocks": None if index_blocks is None else index_blocks.get(KV_POOL_ID, 0),
    }
    return {"backends": out, "policy": gw.settings.routing.policy, "index": gw.settings.index.backend,
            "kv_pool": kv_pool}


@router.post("/v1/kappa/route")
async def explain(request: Request, gw: State) -> dict[str, Any]:
    """Explain the decision for a chat or completions body without sending it.

    ``kappa_crit`` is null where no K makes the request transfer-bound at its T (the
    attention-aware κ_crit(T) is infinite there; `router.kappa.kappa_crit`)."""
    raw = await read_body(request, gw.settings.gateway.max_body_bytes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if isinstance(body, dict) and "messages" in body:
        kind = "chat"
    elif isinstance(body, dict) and "prompt" in body:
        kind = "completion"
    elif isinstance(body, dict):
        raise BadRequest("The body needs 'messages' (chat) or 'prompt' (completions).")
    else:
        kind = "chat"  # parse() answers that the body must be a JSON object
    plan = await gw.routing.plan(gw.routing.parse(kind, raw), dry_run=True)
    rank = {c.backend_id: i for i, c in enumerate(plan.decision.ranked)}
    candidates = []
    for c in sorted(plan.decision.ranked, key=lambda c: rank[c.backend_id]):
        est = c.estimate
        candidates.append({
            "backend": c.backend_id, "rank": rank[c.backend_id],
            "hardware": plan.targets[c.backend_id].entry.hardware,
            "cached_hbm_tokens": c.cached_hbm_tokens, "cached_host_tokens": c.cached_host_tokens,
            "cached_kv_pool_tokens": c.cached_kv_pool_tokens,
            "uncached_prompt_tokens": c.uncached_prompt_tokens, "kappa_ratio": est.kappa_ratio, "kappa_crit": _finite(est.kappa_crossover),
            "regime": est.regime.value, "admitted": c.admitted,
            "predicted_ttft_s": est.ttft_s, "predicted_prefill_s": est.prefill_s,
            "t_compute_s": est.t_compute_s, "t_load_s": est.t_load_s,
            "predicted_energy_j": est.energy_j, "kv_demand_bytes": est.kv_demand_bytes,
        })
    f = plan.features
    return {
        "model": f.model, "kind": kind, "policy": plan.decision.policy, "chosen": plan.decision.chosen.backend_id,
        "reason": plan.decision.reason, "index_available": plan.index_ok,
        "prompt_tokens_estimate": f.prompt_tokens, "prompt_blocks": f.prompt_blocks,
        "tokens_per_block_estimate": f.block_size_tokens, "max_tokens": f.max_tokens, "n": f.sequences,
        "candidates": candidates,
    }
