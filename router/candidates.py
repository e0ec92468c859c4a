"""Per-backend figures for one request: K by tier, T, the cost estimate, admission.

Every policy ranks the same candidates, so the explain endpoint, the response headers and
the metrics show the same K, T, κ_ratio and κ_crit whichever policy chose.

Admission (memory-aware accounting): a request occupies (K + T + n·max_tokens)·B_kv of KV on
the backend that serves it, for n output sequences sharing the prompt's blocks
(`router.cost.kv_demand_bytes`) — the cached prefix it pins as well as what it adds — so it is
admitted where that fits the backend's free KV memory (capacity − KV already charged to
in-flight requests by the gateway's ledger). A token-budget scheduler would count only T:
65k cached + 32 new tokens "costs" 32 tokens there, yet pins 65k tokens of KV
(REFERENCE.md §1 scheduler example). The prefix blocks that other requests in flight on
that backend already hold (``BackendView.in_flight_blocks``) are shared by reference, as
vLLM shares them, and already charged to those requests: they are not charged again.
Counting them once per request would make a backend whose conversations overlap look full
and send their follow-ups to recompute elsewhere (measured in the simulator: BENCHMARKS.md,
"Where κ routing wins, where it does not, and why"). The charge is released when its request
ends, so a shared prefix can go uncounted while a later request still holds it: the ledger
errs low there, and the backend's own queue is the backstop.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.cost import RequestShape, UnqueuedEstimate, predict_unqueued, with_queue_wait
from router.types import BackendView, Candidate, RequestFeatures


def build_candidates(features: RequestFeatures, views: Sequence[BackendView]) -> list[Candidate]:
    """One `Candidate` per view, in the views' order.

    K per tier (HBM, host tier, fleet-shared pool) = matched index blocks × tokens per block,
    capped so that at least one prompt token is computed (vLLM caps hits at P − 1); T = P − K. The queue wait fed to
    the cost model is the view's outstanding prefill seconds (the gateway's ledger).
    """
    prompt = max(features.prompt_tokens, 1)
    output = max(features.max_tokens, 1)
    block = features.block_size_tokens
    # Backends that share a spec (same object: `fleet_config` interns equal specs) and the same
    # K by tier get the same prediction but for the queue wait: computed once per request.
    unqueued: dict[tuple[int, int, int, int, int], UnqueuedEstimate] = {}
    out = []
    for view in views:
        hbm = min(int(view.hbm_blocks * block), prompt - 1)
        host = min(int(view.host_blocks * block), prompt - 1 - hbm)
        kv_pool = min(int(view.kv_pool_blocks * block), prompt - 1 - hbm - host)
        uncached = prompt - hbm - host - kv_pool
        held = min(int(view.in_flight_blocks * block), hbm)
        key = (id(view.spec), hbm, host, kv_pool, held)
        base = unqueued.get(key)
        if base is None:
            base = unqueued[key] = predict_unqueued(
                RequestShape(hbm, host, uncached, output, kv_pool, held, features.sequences), view.spec)
        estimate = with_queue_wait(base, view.outstanding_prefill_s)
        admitted = estimate.kv_demand_bytes <= view.free_kv_bytes
        out.append(Candidate(view.backend_id, hbm, host, uncached, estimate, admitted, kv_pool))
    return out
