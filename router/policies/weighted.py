"""``weighted``: llm-d's default scorer mix (inference scheduler), highest total score wins.

Category: affinity + distribution. Scores in [0, 1] per backend (REFERENCE.md §6):
- prefix-cache score = matched blocks / prompt blocks (0 for a prompt with no full block);
- queue score = min-max normalised waiting queue, fewer is better (1 when all are equal);
- KV-utilisation score = 1 − kv_cache_usage (scraped, a fraction).
Total = prefix_weight·prefix + queue_weight·queue + kv_weight·kv; ties at random.

Parameters (llm-d's defaults): prefix_weight 3, queue_weight 2, kv_weight 2.

YAML::

    routing:
      policy: weighted
      params: {prefix_weight: 3.0, queue_weight: 2.0, kv_weight: 2.0}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from router.policies.base import PolicyConfigError, check_params, rank_by
from router.types import BackendView, Candidate, Decision, RequestFeatures


def queue_scores(waiting: Sequence[int]) -> list[float]:
    """Min-max normalised, fewer waiting is better; all 1.0 when every queue is equal."""
    lo, hi = min(waiting), max(waiting)
    if hi == lo:
        return [1.0] * len(waiting)
    return [(hi - w) / (hi - lo) for w in waiting]


class WeightedPolicy:
    name: ClassVar[str] = "weighted"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        if min(prefix_weight, queue_weight, kv_weight) < 0:
            raise PolicyConfigError("policy 'weighted': weights must be >= 0")
        self.weights = (prefix_weight, queue_weight, kv_weight)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> WeightedPolicy:
        return cls(**check_params(cls.name, params, {
            "prefix_weight": float, "queue_weight": float, "kv_weight": float}))

    def scores(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[float]:
        """Total score per view, in the views' order."""
        w_prefix, w_queue, w_kv = self.weights
        queue = queue_scores([v.num_requests_waiting for v in views])
        out = []
        for view, q in zip(views, queue, strict=True):
            prefix = view.matched_blocks / features.prompt_blocks if features.prompt_blocks else 0.0
            kv = 1.0 - min(max(view.kv_cache_usage_ratio, 0.0), 1.0)
            out.append(w_prefix * min(prefix, 1.0) + w_queue * q + w_kv * kv)
        return out

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        scores = self.scores(features, views)
        ranked = rank_by(candidates, [-s for s in scores], rng)
        return Decision(self.name, ranked, f"highest weighted score {max(scores):.2f}")
