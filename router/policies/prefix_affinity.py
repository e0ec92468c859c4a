"""``prefix-affinity``: SGLang's ``cache_aware`` policy (sgl-router), on the shared prefix index.

Category: affinity with a load guard. As SGLang decides (REFERENCE.md §6):
1. Load imbalanced — max − min in-flight > ``balance_abs_threshold`` and
   max > ``balance_rel_threshold`` × min: the least-loaded backend.
2. Else, if the best match ratio K / P exceeds ``cache_threshold``: the longest match.
3. Else the backend with the smallest cache tree (fewest indexed blocks: most free cache).

Differences from SGLang, stated: the match comes from our block index (both tiers), not
a per-worker character tree, and entries leave it by capacity trimming, not a 60 s TTL.

Parameters (SGLang's defaults): balance_abs_threshold 64 (requests),
balance_rel_threshold 1.5, cache_threshold 0.3 (fraction of the prompt).

YAML::

    routing:
      policy: prefix-affinity
      params: {balance_abs_threshold: 64, balance_rel_threshold: 1.5, cache_threshold: 0.3}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from router.policies.base import PolicyConfigError, check_params, rank_by
from router.types import BackendView, Candidate, Decision, RequestFeatures


class PrefixAffinityPolicy:
    name: ClassVar[str] = "prefix-affinity"

    def __init__(self, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 cache_threshold: float = 0.3) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1 or not 0 <= cache_threshold <= 1:
            raise PolicyConfigError(
                "policy 'prefix-affinity': balance_abs_threshold >= 0, balance_rel_threshold >= 1, "
                "cache_threshold in [0, 1]")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PrefixAffinityPolicy:
        return cls(**check_params(cls.name, params, {
            "balance_abs_threshold": int, "balance_rel_threshold": float, "cache_threshold": float}))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        loads = [v.in_flight for v in views]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return Decision(self.name, rank_by(candidates, loads, rng), "load imbalanced: least loaded")
        prompt = max(features.prompt_tokens, 1)
        best_ratio = max(c.cached_tokens for c in candidates) / prompt
        if best_ratio > self.cache_threshold:
            ranked = rank_by(candidates, [-c.cached_tokens for c in candidates], rng)
            return Decision(self.name, ranked, f"longest prefix match ({best_ratio:.0%} of the prompt)")
        ranked = rank_by(candidates, [v.cached_blocks for v in views], rng)
        return Decision(self.name, ranked, "low match: smallest cache tree")
