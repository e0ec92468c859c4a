"""``pd-llmd``: llm-d's P/D decision — split iff the decode pod's uncached prompt is long enough.

Category: affinity + distribution. llm-d's inference scheduler (``llm-d-inference-scheduler``,
``pkg/plugins/profile/prefix_based_pd_decider.go``, plugin type ``prefix-based-pd-decider``, run by
the ``disagg-profile-handler``) schedules the decode profile first: the decode pod is the best of
the decode-filter's pods (role decode or both) by the profile's scorers. The decider then reads that
pod's prefix-cache match and splits iff

    nonCachedTokens > 0  and  P ≥ promptTokens  and  P − K_d ≥ nonCachedTokens

(P the prompt, estimated from its characters; K_d the decode pod's matched tokens); otherwise the
decode pod serves the request whole. A split runs the prefill profile: the best of the
prefill-filter's pods (role prefill) by the same scorers. The scorers are llm-d's defaults,
prefix-cache 3, queue 2, kv-utilisation 2 (`router.policies.weighted`, REFERENCE.md §6).

Defaults: ``nonCachedTokens`` is 0 in the code, which disables splitting; llm-d's P/D guide
(well-lit path) and its test configs deploy ``nonCachedTokens: 16``, taken here.
``promptTokens`` (a minimum prompt, later versions' parameter) defaults to 0: no minimum.

Parameters: `PdLlmdParams`.

YAML::

    routing:
      policy: pd-llmd
      params: {non_cached_tokens: 16, prompt_tokens: 0}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, rank_by, require
from router.policies.pd_split import first_linked, pools, split_decision
from router.policies.weighted import WeightedPolicy
from router.types import BackendView, Candidate, Decision, PdFleet, RequestFeatures

NAME = "pd-llmd"
DEFAULT_NON_CACHED_TOKENS = 16  # llm-d's P/D guide config (0 in the code disables the split)
DEFAULT_PROMPT_TOKENS = 0  # no minimum prompt


@dataclass(frozen=True, slots=True)
class PdLlmdParams:
    """The ``pd-llmd`` policy's parameters (llm-d's decider's, in tokens).

    Attributes:
        non_cached_tokens: uncached tokens on the decode pod (≥ 0) from which a request is split;
            0 never splits (llm-d's ``nonCachedTokens``).
        prompt_tokens: prompt tokens (≥ 0) below which a request is never split (``promptTokens``).
        prefix_weight, queue_weight, kv_weight: the scorers' weights (`router.policies.weighted`).

    Raises:
        PolicyConfigError: a negative value (the message names it).
    """

    non_cached_tokens: int = DEFAULT_NON_CACHED_TOKENS
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        for name in ("non_cached_tokens", "prompt_tokens", "prefix_weight", "queue_weight", "kv_weight"):
            value = getattr(self, name)
            require(NAME, name, value, value >= 0, ">= 0")


def splits(params: PdLlmdParams, prompt_tokens: int, decode_cached_tokens: int) -> bool:
    """llm-d's decider: whether a request of ``prompt_tokens`` whose decode pod caches
    ``decode_cached_tokens`` of it is split."""
    if params.non_cached_tokens <= 0 or prompt_tokens < params.prompt_tokens:
        return False
    return prompt_tokens - decode_cached_tokens >= params.non_cached_tokens


class PdLlmdPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "affinity+distribution"
    disaggregates: ClassVar[bool] = True

    def __init__(self, params: PdLlmdParams = PdLlmdParams()) -> None:
        self.params = params
        self._scorer = WeightedPolicy.from_params({"prefix_weight": params.prefix_weight,
                                                   "queue_weight": params.queue_weight, "kv_weight": params.kv_weight})

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, PdLlmdParams, params))

    def _rank(self, features: RequestFeatures, cands: Sequence[Candidate], views: Sequence[BackendView],
              rng: random.Random) -> tuple[Candidate, ...]:
        return rank_by(cands, [-s for s in self._scorer.scores(features, views)], rng)

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        return Decision(self.name, self._rank(features, candidates, views, rng), "llm-d default scorers")

    def decide_pd(self, features: RequestFeatures, candidates: Sequence[Candidate], views: Sequence[BackendView],
                  pd: PdFleet, rng: random.Random) -> Decision:
        """Decode pod by the scorers; split iff the decider says so and a prefill pod links to it."""
        (p_cands, p_views), (d_cands, d_views) = pools(candidates, views, pd)
        decode_ranked = self._rank(features, d_cands, d_views, rng)
        chosen = decode_ranked[0]
        prompt, uncached = features.prompt_tokens, features.prompt_tokens - chosen.cached_tokens
        if not splits(self.params, prompt, chosen.cached_tokens):
            return Decision(self.name, decode_ranked, f"decode only: {uncached} uncached tokens on {chosen.backend_id} "
                            f"(split from {self.params.non_cached_tokens})")
        prefill_only = [(c, v) for c, v in zip(p_cands, p_views) if pd.role(c.backend_id) == "prefill"]
        linked = None
        if prefill_only:
            ranked = self._rank(features, [c for c, _ in prefill_only], [v for _, v in prefill_only], rng)
            linked = first_linked(ranked, chosen.backend_id, pd)
        if linked is None:
            return Decision(self.name, decode_ranked, f"no prefill pod links to {chosen.backend_id}: decode only")
        return split_decision(self.name, features, linked[0], linked[1], decode_ranked, d_views[d_cands.index(chosen)],
                              f"split: {uncached} uncached tokens on {chosen.backend_id} >= "
                              f"{self.params.non_cached_tokens}; prefill on {linked[0].backend_id}")
