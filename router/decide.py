"""One routing decision: candidates from the views, ranked by the configured policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.candidates import build_candidates
from router.errors import NoEligibleBackend
from router.policies import Policy
from router.types import BackendView, Decision, PdFleet, RequestFeatures


def decide(policy: Policy, features: RequestFeatures, views: Sequence[BackendView], rng: random.Random,
           pd: PdFleet | None = None) -> Decision:
    """Rank the healthy backends serving ``features.model`` for this request.

    Backends whose total KV capacity is smaller than the request's (K+T+max_tokens)·B_kv are
    left out of the ranking when at least one other can hold it.

    Args:
        policy: the configured policy.
        features: the request's estimated sizes.
        views: one snapshot per eligible backend (healthy, serving the model), non-empty.
        rng: the randomness for tie-breaks.
        pd: on a P/D fleet, roles and usable links (``None``: an aggregated fleet, as ever). A
            policy that ``disaggregates`` then decides with its ``decide_pd`` (it may split the
            request: `Decision.prefill`); any other ranks the backends that decode (a ``prefill``
            backend only prefills for others).

    Raises:
        NoEligibleBackend: ``views`` is empty.
    """
    if not views:
        raise NoEligibleBackend(f"no healthy backend serves model {features.model!r}")
    candidates = build_candidates(features, views)
    # A backend whose whole KV cache cannot hold the request would reject it: leave it out,
    # unless none can (then the estimate may be off, and the backends decide).
    fits = [i for i, c in enumerate(candidates) if c.estimate.kv_demand_bytes <= views[i].kv_capacity_bytes]
    if fits and len(fits) < len(candidates):
        candidates = [candidates[i] for i in fits]
        views = [views[i] for i in fits]
    if pd is None:
        return policy.decide(features, candidates, views, rng)
    if getattr(policy, "disaggregates", False):
        return policy.decide_pd(features, candidates, views, pd, rng)  # type: ignore[attr-defined]
    keep = [i for i, c in enumerate(candidates) if pd.role(c.backend_id) != "prefill"]
    if keep and len(keep) < len(candidates):
        candidates = [candidates[i] for i in keep]
        views = [views[i] for i in keep]
    return policy.decide(features, candidates, views, rng)
