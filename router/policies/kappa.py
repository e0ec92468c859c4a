"""``kappa`` (default): least predicted TTFT under memory-aware admission, ties to lower energy.

Category: cost-based (affinity and distribution at once). For each candidate the cost model
(`router.cost.predict`) prices this request on that backend — its cached prefix by tier,
its T, the backend's C_eff and sustained link, and the prefill work the gateway already
queued there — so a high-κ request goes where loading its prefix is cheap (KV in HBM, or
a fast link) and a large-T prefill where compute is dense. Backends where
(K + T + max_tokens)·B_kv does not fit the free KV memory rank after those where it does.
Among candidates whose TTFT is within ``energy_tie_ratio`` of the best, the lower
predicted energy wins (power-capped and transfer-bound placements are cheaper in joules).

Parameters:
    energy_tie_ratio (float, default 0.05): relative TTFT band counted as a tie.

YAML::

    routing:
      policy: kappa
      params:
        energy_tie_ratio: 0.05
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from router.policies.base import PolicyConfigError, check_params
from router.types import BackendView, Candidate, Decision, RequestFeatures

DEFAULT_ENERGY_TIE_RATIO = 0.05


class KappaPolicy:
    name = "kappa"

    def __init__(self, energy_tie_ratio: float = DEFAULT_ENERGY_TIE_RATIO) -> None:
        if not 0 <= energy_tie_ratio < 1:
            raise PolicyConfigError("policy 'kappa': energy_tie_ratio must be in [0, 1)")
        self.energy_tie_ratio = energy_tie_ratio

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> KappaPolicy:
        return cls(**check_params(cls.name, params, {"energy_tie_ratio": float}))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        admitted = [c for c in candidates if c.admitted]
        rest = [c for c in candidates if not c.admitted]
        ranked = self._rank(admitted, rng) + self._rank(rest, rng)
        best = ranked[0]
        reason = (f"least predicted TTFT {best.estimate.ttft_s:.4f}s ({best.estimate.regime.value}-bound)"
                  + ("" if best.admitted else "; no backend had free KV memory for it"))
        return Decision(self.name, ranked, reason)

    def _rank(self, cands: list[Candidate], rng: random.Random) -> tuple[Candidate, ...]:
        if not cands:
            return ()
        jitter = {c.backend_id: rng.random() for c in cands}
        by_ttft = sorted(cands, key=lambda c: (c.estimate.ttft_s, jitter[c.backend_id]))
        band = by_ttft[0].estimate.ttft_s * (1 + self.energy_tie_ratio)
        tied = [c for c in by_ttft if c.estimate.ttft_s <= band]
        tied.sort(key=lambda c: (c.estimate.energy_j, c.estimate.ttft_s))
        return tuple(tied) + tuple(by_ttft[len(tied):])
