"""``kappa`` (default): least predicted TTFT plus the prefill work it adds, under memory-aware
admission, ties to lower energy.

Category: cost (affinity and distribution priced at once). For each candidate the cost model
(`router.cost.predict`) prices this request on that backend — its cached prefix by tier,
its T, the backend's C_eff and its host and pool links, and the prefill work the gateway
already queued there — so a high-κ request goes where loading its prefix is cheap (KV in
HBM, or a fast link) and a large-T prefill where compute is dense. The score is

    predicted TTFT + work_weight · predicted prefill seconds

The second term is what this request costs the others: its prefill holds that backend for
prefill seconds, and every request queued behind it waits as long. Greedy TTFT alone
ignores it, and under load moves a conversation off the backend holding its prefix to a
shorter queue where it recomputes the prefix, work that then delays everyone there. With
nothing queued the term changes little: the fastest prefill is usually also the least work.
Its effect on the simulated workloads is measured in BENCHMARKS.md (`bench/routing_quality.py`).

Backends where (K + T + max_tokens)·B_kv does not fit the free KV memory rank after those
where it does. Among candidates whose score is within ``energy_tie_ratio`` of the best,
the lower predicted energy wins (power-capped and transfer-bound placements are cheaper in
joules).

Parameters: `KappaParams`.

YAML::

    routing:
      policy: kappa
      params:
        energy_tie_ratio: 0.05
        work_weight: 1.0
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, require
from router.types import BackendView, Candidate, Decision, RequestFeatures

NAME = "kappa"

# A power cap moves a backend's predicted TTFT by a few percent (650 W leaves an H100 SXM
# (580/630)^(1/3) of its clocks at 93% of its power): a 5% band lets the cheaper joules win
# such near-ties, and no wider gap.
DEFAULT_ENERGY_TIE_RATIO = 0.05
# Each second this request's prefill holds a backend is a second every request queued behind
# it waits: weight 1 charges it once, as one more waiting request would feel it.
DEFAULT_WORK_WEIGHT = 1.0


@dataclass(frozen=True, slots=True)
class KappaParams:
    """The ``kappa`` policy's parameters (``routing.params``).

    Attributes:
        energy_tie_ratio: relative score band, in [0, 1), within which candidates count as
            tied and the lower predicted energy wins (0.05: a score ≤ 1.05 × the best).
        work_weight: weight (seconds per second, ≥ 0) of the request's own predicted prefill
            seconds added to its predicted TTFT; 0 ranks by predicted TTFT alone.

    Raises:
        PolicyConfigError: a value out of range (the message names the parameter).
    """

    energy_tie_ratio: float = DEFAULT_ENERGY_TIE_RATIO
    work_weight: float = DEFAULT_WORK_WEIGHT

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)

    def __post_init__(self) -> None:
        ratio, weight = self.energy_tie_ratio, self.work_weight
        require(NAME, "energy_tie_ratio", ratio, 0 <= ratio < 1, "in [0, 1)")
        require(NAME, "work_weight", weight, weight >= 0, ">= 0")


class KappaPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "cost"

    def __init__(self, params: KappaParams = KappaParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming a bad or unknown key."""
        return cls(parse_params(NAME, KappaParams, params))

    def score(self, candidate: Candidate) -> float:
        """Predicted TTFT + work_weight · predicted prefill, seconds (lower is better)."""
        est = candidate.estimate
        return est.ttft_s + self.params.work_weight * est.prefill_s

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        admitted = [c for c in candidates if c.admitted]
        rest = [c for c in candidates if not c.admitted]
        ranked = self._rank(admitted, rng) + self._rank(rest, rng)
        best = ranked[0]
        reason = (f"least predicted TTFT {best.estimate.ttft_s:.4f}s + {self.params.work_weight:g} × prefill "
                  f"{best.estimate.prefill_s:.4f}s ({best.estimate.regime.value}-bound)"
                  + ("" if best.admitted else "; no backend had free KV memory for it"))
        return Decision(self.name, ranked, reason)

    def _rank(self, cands: list[Candidate], rng: random.Random) -> tuple[Candidate, ...]:
        if not cands:
            return ()
        jitter = {c.backend_id: rng.random() for c in cands}
        scores = {c.backend_id: self.score(c) for c in cands}
        by_score = sorted(cands, key=lambda c: (scores[c.backend_id], jitter[c.backend_id]))
        band = scores[by_score[0].backend_id] * (1 + self.params.energy_tie_ratio)
        tied = [c for c in by_score if scores[c.backend_id] <= band]
        tied.sort(key=lambda c: (c.estimate.energy_j, scores[c.backend_id]))
        return tuple(tied) + tuple(by_score[len(tied):])
