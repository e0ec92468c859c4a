"""``least-loaded``: fewest in-flight requests, counted by the gateway at decision time.

Category: distribution. The count is the gateway's own ledger, updated when it decides
(not when a response ends), so a burst spreads instead of piling onto one backend; ties are
broken at random (REFERENCE.md §6). No parameters. YAML: ``routing: {policy: least-loaded}``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from router.policies.base import check_params, rank_by
from router.types import BackendView, Candidate, Decision, RequestFeatures


class LeastLoadedPolicy:
    name: ClassVar[str] = "least-loaded"

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> LeastLoadedPolicy:
        check_params(cls.name, params, {})
        return cls()

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        ranked = rank_by(candidates, [v.in_flight for v in views], rng)
        return Decision(self.name, ranked, "fewest in-flight requests")
