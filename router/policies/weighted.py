"""``weighted``: llm-d's default scorer mix (inference scheduler), highest total score wins.

Category: affinity + distribution. Scores in [0, 1] per backend (REFERENCE.md §6):
- prefix-cache score = matched blocks / prompt blocks (0 for a prompt with no full block);
- queue score = min-max normalised waiting queue, fewer is better (1 when all are equal);
- KV-utilisation score = 1 − kv_cache_usage (scraped, a fraction).
Total = prefix_weight·prefix + queue_weight·queue + kv_weight·kv; ties at random.

Parameters: `WeightedParams` (llm-d's default weights).

YAML::

    routing:
      policy: weighted
      params: {prefix_weight: 3.0, queue_weight: 2.0, kv_weight: 2.0}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, rank_by, require
from router.types import BackendView, Candidate, Decision, RequestFeatures

NAME = "weighted"

# The weights of llm-d's default scheduling profile (REFERENCE.md §6).
DEFAULT_PREFIX_WEIGHT = 3.0
DEFAULT_QUEUE_WEIGHT = 2.0
DEFAULT_KV_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class WeightedParams:
    """The ``weighted`` policy's parameters (``routing.params``): dimensionless weights, each ≥ 0.

    Attributes:
        prefix_weight: weight of the prefix-cache score.
        queue_weight: weight of the queue score.
        kv_weight: weight of the KV-utilisation score.

    Raises:
        PolicyConfigError: a negative or non-finite weight (the message names it).
    """

    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    queue_weight: float = DEFAULT_QUEUE_WEIGHT
    kv_weight: float = DEFAULT_KV_WEIGHT

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        require(NAME, "prefix_weight", self.prefix_weight, self.prefix_weight >= 0, ">= 0")
        require(NAME, "queue_weight", self.queue_weight, self.queue_weight >= 0, ">= 0")
        require(NAME, "kv_weight", self.kv_weight, self.kv_weight >= 0, ">= 0")


def queue_scores(waiting: Sequence[int]) -> list[float]:
    """Min-max normalised, fewer waiting is better; all 1.0 when every queue is equal."""
    lo, hi = min(waiting), max(waiting)
    if hi == lo:
        return [1.0] * len(waiting)
    return [(hi - w) / (hi - lo) for w in waiting]


class WeightedPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "affinity+distribution"

    def __init__(self, params: WeightedParams = WeightedParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, WeightedParams, params))

    def scores(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[float]:
        """Total score per view, in the views' order."""
        w_prefix, w_queue, w_kv = self.params.prefix_weight, self.params.queue_weight, self.params.kv_weight
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
