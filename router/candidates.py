"""Per-backend figures for one request: K by tier, T, the cost estimate, admission.

Every policy ranks the same candidates, so the explain endpoint, the response headers and
the metrics show the same K, T, κ_ratio and κ_crit whichever policy chose.

Admission (memory-aware accounting): a request occupies (K + T + max_tokens)·B_kv of KV on
the backend that serves it — the cached prefix it pins as well as what it adds — so it is
admitted where that fits the backend's free KV memory (capacity − KV already charged to
in-flight requests by the gateway's ledger). A token-budget scheduler would count only T:
65k cached + 32 new tokens "costs" 32 tokens there, yet pins 65k tokens of KV
(REFERENCE.md §1 scheduler example).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.cost import RequestShape, predict
from router.types import BackendView, Candidate, RequestFeatures


def build_candidates(features: RequestFeatures, views: Sequence[BackendView]) -> list[Candidate]:
    """One `Candidate` per view, in the views' order.

    K per tier (HBM, host tier, fleet-shared pool) = matched index blocks × tokens per block,
    capped so that at least one prompt token is computed (vLLM caps hits at P − 1); T = P − K. The queue wait fed to
    the cost model is the view's outstanding prefill seconds (the gateway's ledger).
    """
    prompt = max(features.prompt_tokens, 1)
    out = []
    for view in views:
        hbm = min(int(view.hbm_blocks * features.block_size_tokens), prompt - 1)
        host = min(int(view.host_blocks * features.block_size_tokens), prompt - 1 - hbm)
        pool = min(int(view.pool_blocks * features.block_size_tokens), prompt - 1 - hbm - host)
        new = prompt - hbm - host - pool
        estimate = predict(
            RequestShape(hbm, host, new, max(features.max_tokens, 1), pool), view.spec,
            queue_wait_s=view.outstanding_prefill_s,
        )
        admitted = estimate.kv_demand_bytes <= view.free_kv_bytes
        out.append(Candidate(view.backend_id, hbm, host, new, estimate, admitted, pool))
    return out
