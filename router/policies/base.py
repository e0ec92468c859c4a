"""The policy interface: rank the candidates of one request, best first.

A policy is a small object built from its YAML parameters (validated, never defaulted on
error); it may keep its own state (a round-robin cursor) but reads no clock and does no
I/O. Randomness comes from the `random.Random` the caller passes, so runs are
reproducible for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from router.errors import RouterError
from router.types import BackendView, Candidate, Decision, RequestFeatures


class PolicyConfigError(RouterError, ValueError):
    """A policy parameter is unknown or out of range (the message names it)."""


class Policy(Protocol):
    @property
    def name(self) -> str:
        """The policy's name in configuration and metrics."""
        ...

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        """Rank ``candidates`` (aligned with ``views``, same order, non-empty) best first."""
        ...


def check_params(policy: str, params: Mapping[str, Any], allowed: Mapping[str, type]) -> dict[str, Any]:
    """Validate a policy's YAML parameters: known names, right types. Raises PolicyConfigError."""
    out = {}
    for key, value in params.items():
        if key not in allowed:
            raise PolicyConfigError(f"policy {policy!r}: unknown parameter {key!r} (known: {sorted(allowed)})")
        kind = allowed[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PolicyConfigError(f"policy {policy!r}: parameter {key!r} must be {kind.__name__}, got {value!r}")
        out[key] = value
    return out


def rank_by(candidates: Sequence[Candidate], keys: Sequence[float], rng: random.Random) -> tuple[Candidate, ...]:
    """Candidates sorted by ascending key, ties broken at random (reproducibly for the rng)."""
    jitter = [rng.random() for _ in candidates]
    order = sorted(range(len(candidates)), key=lambda i: (keys[i], jitter[i]))
    return tuple(candidates[i] for i in order)
