"""``least-loaded``: fewest in-flight requests, counted by the gateway at decision time.

Category: distribution. The count is the gateway's own ledger, updated when it decides
(not when a response ends), so a burst spreads instead of piling onto one backend; ties are
broken at random (REFERENCE.md §6). No parameters. YAML: ``routing: {policy: least-loaded}``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params, rank_by
from router.types import BackendView, Candidate, Decision, RequestFeatures

NAME = "least-loaded"


@dataclass(frozen=True, slots=True)
class LeastLoadedParams:
    """The ``least-loaded`` policy takes no parameters: any key is unknown."""

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)


class LeastLoadedPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "distribution"

    def __init__(self, params: LeastLoadedParams = LeastLoadedParams()) -> None:
        self.params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming an unknown key."""
        return cls(parse_params(NAME, LeastLoadedParams, params))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        ranked = rank_by(candidates, [v.in_flight for v in views], rng)
        return Decision(self.name, ranked, "fewest in-flight requests")
