"""``pd-always``: every request split, as vLLM production-stack's and SGLang's P/D routers do.

Category: affinity (or distribution, with ``picker: round-robin``). Neither router decides whether to
split: each request is prefilled on a prefill worker and decoded on a decode worker. They differ in
how they pick the two:

- SGLang (sgl-router / sgl-model-gateway, ``src/routers/http/pd_router.rs``; defaults in
  ``py_src/sglang_router/router_args.py``): ``prefill_policy`` and ``decode_policy`` default to the
  router's ``policy``, ``cache_aware`` (cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5), each pool with its own tree: `router.policies.prefix_affinity`.
  This policy's default, ``picker: cache-aware``.
- production-stack (``src/vllm_router/routers/routing_logic.py``,
  ``DisaggregatedPrefillOrchestratedRouter``, the ``kv_transfer_params`` flow): round-robin over
  the prefill endpoints and, with its own counter, over the decode endpoints (sorted by URL; here in
  config order). ``picker: round-robin``.

The prefill pick is the first in that pool's ranking with a usable link to the decode pick
(`router.policies.pd_split`); with none the request is served whole on the decode pick. On an
aggregated fleet it is the picker over every backend.

Parameters: `PdAlwaysParams`.

YAML::

    routing:
      policy: pd-always
      params: {picker: cache-aware}   # or round-robin (production-stack)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import PolicyConfigError, params_reduce, parse_params
from router.policies.pd_split import first_linked, pools, split_decision
from router.policies.prefix_affinity import PrefixAffinityPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.types import BackendView, Candidate, Decision, PdFleet, RequestFeatures

NAME = "pd-always"
PICKERS = ("cache-aware", "round-robin")
DEFAULT_PICKER = "cache-aware"  # SGLang's default policy (production-stack's is round-robin)


@dataclass(frozen=True, slots=True)
class PdAlwaysParams:
    """The ``pd-always`` policy's parameters.

    Attributes:
        picker: how each pool's worker is picked: ``cache-aware`` (SGLang) or ``round-robin``
            (production-stack).

    Raises:
        PolicyConfigError: an unknown picker.
    """

    picker: str = DEFAULT_PICKER

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        if self.picker not in PICKERS:
            raise PolicyConfigError(f"policy {NAME!r}: picker must be one of {PICKERS}, got {self.picker!r}")


class PdAlwaysPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "affinity"
    disaggregates: ClassVar[bool] = True

    def __init__(self, params: PdAlwaysParams = PdAlwaysParams()) -> None:
        self.params = params
        make = PrefixAffinityPolicy if params.picker == "cache-aware" else RoundRobinPolicy
        self._prefill_picker, self._decode_picker = make(), make()  # one state (turn) per pool

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, PdAlwaysParams, params))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        ranked = self._decode_picker.decide(features, candidates, views, rng)
        return Decision(self.name, ranked.ranked, f"{self.params.picker}: {ranked.reason}")

    def decide_pd(self, features: RequestFeatures, candidates: Sequence[Candidate], views: Sequence[BackendView],
                  pd: PdFleet, rng: random.Random) -> Decision:
        """Always split: decode pick from the decode pool, prefill pick from the prefill pool."""
        (p_cands, p_views), (d_cands, d_views) = pools(candidates, views, pd)
        decode = self._decode_picker.decide(features, d_cands, d_views, rng)
        chosen = decode.ranked[0]
        d_view = d_views[d_cands.index(chosen)]
        linked = None
        if p_cands:
            prefill = self._prefill_picker.decide(features, p_cands, p_views, rng)
            linked = first_linked(prefill.ranked, chosen.backend_id, pd)
        if linked is None:
            return Decision(self.name, decode.ranked, f"no usable link to {chosen.backend_id}: whole there")
        return split_decision(self.name, features, linked[0], linked[1], decode.ranked, d_view,
                              f"always split ({self.params.picker}): prefill on {linked[0].backend_id}, "
                              f"decode on {chosen.backend_id} ({decode.reason})")
