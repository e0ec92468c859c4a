"""One routing decision: candidates from the views, ranked by the configured policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.candidates import build_candidates
from router.errors import NoEligibleBackend
from router.policies import Policy
from router.types import BackendView, Decision, RequestFeatures


def decide(policy: Policy, features: RequestFeatures, views: Sequence[BackendView], rng: random.Random) -> Decision:
    """Rank the healthy backends serving ``features.model`` for this request.

    Args:
        policy: the configured policy.
        features: the request's estimated sizes.
        views: one snapshot per eligible backend (healthy, serving the model), non-empty.
        rng: the randomness for tie-breaks.

    Raises:
        NoEligibleBackend: ``views`` is empty.
    """
    if not views:
        raise NoEligibleBackend(f"no healthy backend serves model {features.model!r}")
    return policy.decide(features, build_candidates(features, views), views, rng)
