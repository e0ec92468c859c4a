"""``prefix-affinity``: SGLang's ``cache_aware`` policy (sgl-router), on the shared prefix index.

Category: affinity with a load guard. As SGLang decides (REFERENCE.md §6):
1. Load imbalanced — max − min in-flight > ``balance_abs_threshold_requests`` and
   max > ``balance_rel_threshold`` × min: the least-loaded backend.
2. Else, if the best match ratio K / P exceeds ``cache_threshold_fraction``: the longest match.
3. Else the backend with the smallest cache tree (fewest indexed blocks: most free cache).

Differences from SGLang, stated: the match comes from our block index (both tiers), not
a per-worker character tree, and entries leave it by capacity trimming, not a TTL; the
parameters carry their units in their names (SGLang's ``balance_abs_threshold`` and
``cache_threshold``).

Parameters: `PrefixAffinityParams`.

YAML::

    routing:
      policy: prefix-affinity
      params: {balance_abs_threshold_requests: 64, balance_rel_threshold: 1.5, cache_threshold_fraction: 0.3}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, rank_by, require
from router.types import BackendView, Candidate, Decision, RequestFeatures

NAME = "prefix-affinity"

# SGLang's defaults for cache_aware (sgl-router; REFERENCE.md §6).
DEFAULT_BALANCE_ABS_THRESHOLD_REQUESTS = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_CACHE_THRESHOLD_FRACTION = 0.3


@dataclass(frozen=True, slots=True)
class PrefixAffinityParams:
    """The ``prefix-affinity`` policy's parameters (``routing.params``), SGLang's defaults.

    Attributes:
        balance_abs_threshold_requests: in-flight requests (≥ 0) by which the most loaded
            backend must exceed the least for the load to count as imbalanced.
        balance_rel_threshold: ratio (≥ 1) of the most to the least in-flight count that
            must also be exceeded.
        cache_threshold_fraction: fraction of the prompt, in [0, 1], the best prefix match
            must exceed to route by it.

    Raises:
        PolicyConfigError: a value out of range (the message names the parameter).
    """

    balance_abs_threshold_requests: int = DEFAULT_BALANCE_ABS_THRESHOLD_REQUESTS
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD
    cache_threshold_fraction: float = DEFAULT_CACHE_THRESHOLD_FRACTION

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        abs_requests, rel, fraction = (self.balance_abs_threshold_requests, self.balance_rel_threshold,
                                       self.cache_threshold_fraction)
        require(NAME, "balance_abs_threshold_requests", abs_requests, abs_requests >= 0, ">= 0")
        require(NAME, "balance_rel_threshold", rel, rel >= 1, ">= 1")
        require(NAME, "cache_threshold_fraction", fraction, 0 <= fraction <= 1, "in [0, 1]")


class PrefixAffinityPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "affinity"

    def __init__(self, params: PrefixAffinityParams = PrefixAffinityParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, PrefixAffinityParams, params))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        p = self.params
        loads = [v.in_flight for v in views]
        lo, hi = min(loads), max(loads)
        if hi - lo > p.balance_abs_threshold_requests and hi > p.balance_rel_threshold * lo:
            return Decision(self.name, rank_by(candidates, loads, rng), "load imbalanced: least loaded")
        prompt = max(features.prompt_tokens, 1)
        best_ratio = max(c.cached_tokens for c in candidates) / prompt
        if best_ratio > p.cache_threshold_fraction:
            ranked = rank_by(candidates, [-c.cached_tokens for c in candidates], rng)
            return Decision(self.name, ranked, f"longest prefix match ({best_ratio:.0%} of the prompt)")
        ranked = rank_by(candidates, [v.cached_blocks for v in views], rng)
        return Decision(self.name, ranked, "low match: smallest cache tree")
