"""``round-robin``: each request to the next backend in turn (production-stack and GIE default).

Category: distribution. No parameters. YAML: ``routing: {policy: round-robin}``.
The fallbacks after the choice follow the same rotation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from router.policies.base import check_params
from router.types import BackendView, Candidate, Decision, RequestFeatures


class RoundRobinPolicy:
    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._cursor = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RoundRobinPolicy:
        check_params(cls.name, params, {})
        return cls()

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        start = self._cursor % len(candidates)
        self._cursor += 1
        ranked = tuple(candidates[start:]) + tuple(candidates[:start])
        return Decision(self.name, ranked, "next in turn")
