"""``kappa`` (default): least predicted TTFT plus the prefill work it adds, under memory-aware
admission, ties to lower energy.

Category: cost-based (affinity and distribution at once). For each candidate the cost model
(`router.cost.predict`) prices this request on that backend — its cached prefix by tier,
its T, the backend's C_eff and its host and pool links, and the prefill work the gateway
already queued there — so a high-κ request goes where loading its prefix is cheap (KV in
HBM, or a fast link) and a large-T prefill where compute is dense. The score is

    predicted TTFT + work_weight · predicted prefill seconds

The second term is what this request costs the others: its prefill holds that backend for
prefill seconds, and every request queued behind it waits as long. Greedy TTFT alone
ignores it, and under load moves a conversation off the backend holding its prefix to a
shorter queue where it recomputes the prefix, work that then delays everyone there. On the
simulator's whole-chat workload at 8× its rate (heterogeneous fleet) that cost κ its
affinity (hit ratio 63% against weighted's 77%) and its goodput (2.3 against 15.3 req/s
within a 5 s TTFT); with work_weight 1 it keeps p90 TTFT at 7.5 s against 10.9 s, and
document-QA questions stop starting cold prefills of a document another backend holds
(p90 0.25 → 0.02 s at ×0.5). With nothing queued the term changes little: the fastest
prefill is usually also the least work. (bench/routing_quality.py, BENCHMARKS.md.)

Backends where (K + T + max_tokens)·B_kv does not fit the free KV memory rank after those
where it does. Among candidates whose score is within ``energy_tie_ratio`` of the best,
the lower predicted energy wins (power-capped and transfer-bound placements are cheaper in
joules).

Parameters:
    energy_tie_ratio (float, default 0.05): relative score band counted as a tie.
    work_weight (float, default 1.0, ≥ 0): weight of the request's own prefill seconds; 0
        ranks by predicted TTFT alone.

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
from typing import Any, ClassVar

from router.policies.base import PolicyConfigError, check_params
from router.types import BackendView, Candidate, Decision, RequestFeatures

DEFAULT_ENERGY_TIE_RATIO = 0.05
DEFAULT_WORK_WEIGHT = 1.0


class KappaPolicy:
    name: ClassVar[str] = "kappa"

    def __init__(self, energy_tie_ratio: float = DEFAULT_ENERGY_TIE_RATIO,
                 work_weight: float = DEFAULT_WORK_WEIGHT) -> None:
        if not 0 <= energy_tie_ratio < 1:
            raise PolicyConfigError("policy 'kappa': energy_tie_ratio must be in [0, 1)")
        if work_weight < 0:
            raise PolicyConfigError("policy 'kappa': work_weight must be >= 0")
        self.energy_tie_ratio = energy_tie_ratio
        self.work_weight = work_weight

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> KappaPolicy:
        return cls(**check_params(cls.name, params, {"energy_tie_ratio": float, "work_weight": float}))

    def score(self, candidate: Candidate) -> float:
        """Predicted TTFT + work_weight · predicted prefill, seconds (lower is better)."""
        est = candidate.estimate
        return est.ttft_s + self.work_weight * est.prefill_s

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        admitted = [c for c in candidates if c.admitted]
        rest = [c for c in candidates if not c.admitted]
        ranked = self._rank(admitted, rng) + self._rank(rest, rng)
        best = ranked[0]
        reason = (f"least predicted TTFT {best.estimate.ttft_s:.4f}s + {self.work_weight:g} × prefill "
                  f"{best.estimate.prefill_s:.4f}s ({best.estimate.regime.value}-bound)"
                  + ("" if best.admitted else "; no backend had free KV memory for it"))
        return Decision(self.name, ranked, reason)

    def _rank(self, cands: list[Candidate], rng: random.Random) -> tuple[Candidate, ...]:
        if not cands:
            return ()
        jitter = {c.backend_id: rng.random() for c in cands}
        scores = {c.backend_id: self.score(c) for c in cands}
        by_score = sorted(cands, key=lambda c: (scores[c.backend_id], jitter[c.backend_id]))
        band = scores[by_score[0].backend_id] * (1 + self.energy_tie_ratio)
        tied = [c for c in by_score if scores[c.backend_id] <= band]
        tied.sort(key=lambda c: (c.estimate.energy_j, scores[c.backend_id]))
        return tuple(tied) + tuple(by_score[len(tied):])
