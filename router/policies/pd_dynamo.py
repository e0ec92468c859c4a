"""``pd-dynamo``: NVIDIA Dynamo's conditional disaggregation over its KV router's cost.

Category: affinity + distribution.

Workers (Dynamo's KV router, ``lib/llm/src/kv_router/scheduler.rs``; REFERENCE.md §6): each worker
costs ``overlap_weight × blocks to prefill + active blocks``, the lowest wins (temperature 0, the
default: no sampling; ties at random). Blocks to prefill = (P − K_b) / block; active blocks = the
decode context of the requests in flight there (the ledger's ``context_tokens``) / block: what
Dynamo's ``ActiveSequences`` tracks. The decode worker is the cheapest of the decode pool.

Split (``components/disagg_router.py``, ``PyDisaggregatedRouter.prefill_remote``, with
``--conditional-disagg``): remote prefill iff

    P · (1 − prefix_hit_rate) > max_local_prefill_length   and   prefill queue < max_prefill_queue_size

with the hit rate the decode worker's (its K_d / P), so the first term is P − K_d. Dynamo's prefill
queue is the NATS stream prefill workers pull from, one request at a time each; here its length is
the gateway's prefill requests in flight beyond one per prefill worker. Defaults: 1000 tokens and 2
requests (the same file; the Rust ``DisaggregatedRouter`` keeps the length rule alone). The prefill
worker is the cheapest prefill-role worker by the same cost (Dynamo's KV-aware prefill router),
with a usable link to the decode worker. The "T < 2048 and T/(K+T) < 0.7" rule issue 26 quotes was
not found in Dynamo's sources; this is the rule they carry.

Parameters: `PdDynamoParams`.

YAML::

    routing:
      policy: pd-dynamo
      params: {overlap_weight: 1.0, max_local_prefill_length: 1000, max_prefill_queue_size: 2}
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, rank_by, require
from router.policies.pd_split import first_linked, pools, split_decision
from router.types import BackendView, Candidate, Decision, PdFleet, RequestFeatures

NAME = "pd-dynamo"
DEFAULT_OVERLAP_WEIGHT = 1.0  # Dynamo's --kv-overlap-score-weight
DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 1000  # tokens (PyDisaggregatedRouter)
DEFAULT_MAX_PREFILL_QUEUE_SIZE = 2  # requests (PyDisaggregatedRouter)


@dataclass(frozen=True, slots=True)
class PdDynamoParams:
    """The ``pd-dynamo`` policy's parameters.

    Attributes:
        overlap_weight: weight (≥ 0) of the blocks to prefill against the active blocks.
        max_local_prefill_length: uncached tokens (≥ 0) on the decode worker above which the
            prefill goes remote.
        max_prefill_queue_size: queued remote prefills (≥ 0) from which prefills stay local.

    Raises:
        PolicyConfigError: a negative value (the message names it).
    """

    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    max_prefill_queue_size: int = DEFAULT_MAX_PREFILL_QUEUE_SIZE

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "max_local_prefill_length", "max_prefill_queue_size"):
            value = getattr(self, name)
            require(NAME, name, value, value >= 0, ">= 0")


def kv_cost(params: PdDynamoParams, features: RequestFeatures, candidate: Candidate, view: BackendView) -> float:
    """Dynamo's KV router logit of a worker, in blocks: overlap_weight × blocks to prefill + active blocks."""
    block = max(features.block_size_tokens, 1e-9)
    to_prefill = max(features.prompt_tokens - candidate.cached_tokens, 0) / block
    return params.overlap_weight * to_prefill + view.context_tokens / block


def prefill_remote(params: PdDynamoParams, uncached_tokens: int, queue_size: int) -> bool:
    """Dynamo's conditional rule: remote iff the uncached prompt is long and the prefill queue short."""
    return uncached_tokens > params.max_local_prefill_length and queue_size < params.max_prefill_queue_size


class PdDynamoPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "affinity+distribution"
    disaggregates: ClassVar[bool] = True

    def __init__(self, params: PdDynamoParams = PdDynamoParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, PdDynamoParams, params))

    def _rank(self, features: RequestFeatures, cands: Sequence[Candidate], views: Sequence[BackendView],
              rng: random.Random) -> tuple[Candidate, ...]:
        return rank_by(cands, [kv_cost(self.params, features, c, v) for c, v in zip(cands, views)], rng)

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        return Decision(self.name, self._rank(features, candidates, views, rng), "least KV router cost")

    def decide_pd(self, features: RequestFeatures, candidates: Sequence[Candidate], views: Sequence[BackendView],
                  pd: PdFleet, rng: random.Random) -> Decision:
        """Decode worker by cost; remote prefill iff Dynamo's rule says so and a prefill worker links."""
        (p_cands, p_views), (d_cands, d_views) = pools(candidates, views, pd)
        decode_ranked = self._rank(features, d_cands, d_views, rng)
        chosen = decode_ranked[0]
        uncached = max(features.prompt_tokens - chosen.cached_tokens, 0)
        workers = [(c, v) for c, v in zip(p_cands, p_views) if pd.role(c.backend_id) == "prefill"]
        queue = max(sum(v.in_flight for _, v in workers) - len(workers), 0)
        if not workers or not prefill_remote(self.params, uncached, queue):
            return Decision(self.name, decode_ranked, f"local prefill on {chosen.backend_id}: {uncached} uncached "
                            f"tokens, prefill queue {queue}")
        ranked = self._rank(features, [c for c, _ in workers], [v for _, v in workers], rng)
        linked = first_linked(ranked, chosen.backend_id, pd)
        if linked is None:
            return Decision(self.name, decode_ranked, f"no prefill worker links to {chosen.backend_id}: local prefill")
        return split_decision(self.name, features, linked[0], linked[1], decode_ranked, d_views[d_cands.index(chosen)],
                              f"remote prefill on {linked[0].backend_id}: {uncached} uncached tokens > "
                              f"{self.params.max_local_prefill_length}, prefill queue {queue}")
