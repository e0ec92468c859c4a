"""``round-robin``: each request to the next backend in turn (production-stack and GIE default).

Category: distribution. No parameters. YAML: ``routing: {policy: round-robin}``.
The fallbacks after the choice follow the same rotation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from router.policies.base import params_reduce, parse_params
from router.types import BackendView, Candidate, Decision, RequestFeatures

NAME = "round-robin"


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    """The ``round-robin`` policy takes no parameters: any key is unknown."""

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return params_reduce(self)


class RoundRobinPolicy:
    name: ClassVar[str] = NAME
    category: ClassVar[str] = "distribution"

    def __init__(self, params: RoundRobinParams = RoundRobinParams()) -> None:
        self.params = params
        self._cursor = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A policy from ``routing.params``. Raises PolicyConfigError naming an unknown key."""
        return cls(parse_params(NAME, RoundRobinParams, params))

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        start = self._cursor % len(candidates)
        self._cursor += 1
        ranked = tuple(candidates[start:]) + tuple(candidates[:start])
        return Decision(self.name, ranked, "next in turn")
