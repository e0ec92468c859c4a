"""The policy interface: a factory from validated parameters, and a ranking of one request's candidates.

The shape is llm-d's inference-scheduler plugin (``pkg/plugins/scorer/load_aware.go``): each
policy module holds a type name (``LoadAwareType = "load-aware-scorer"``), a category
(distribution or affinity), a parameters struct whose defaults are the starting point, and a
factory that decodes the config's parameters over those defaults and returns the plugin. Here the struct is a frozen dataclass that validates itself
in ``__post_init__``; the factory (`Policy.from_params`) is part of the protocol; a bad or
unknown parameter is an error naming it, never replaced by its default (llm-d's decoding
ignores unknown keys, and ``NewLoadAware`` puts its default in place of a threshold ≤ 0); and
the registry (`router.policies`) is a fixed table built at import, not a mutable global
that plugins register into.

A policy may keep its own state (a round-robin cursor) but reads no clock and does no I/O.
Randomness comes from the `random.Random` the caller passes, so runs are reproducible for a
seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, TypeVar

from router.errors import RouterError
from router.types import BackendView, Candidate, Decision, RequestFeatures


class PolicyConfigError(RouterError, ValueError):
    """A policy parameter is unknown, of the wrong type or out of range (the message names it)."""


# What a policy's ranking trades: spreading load, staying where the prefix is cached, or
# pricing both in one cost (llm-d's Distribution and Affinity categories, and ours).
CATEGORIES = ("distribution", "affinity", "affinity+distribution", "cost")


class Policy(Protocol):
    """What the router needs of a policy: its name, its factory, its ranking."""

    name: ClassVar[str]
    """The policy's name in configuration and metrics (kebab-case, unique)."""
    category: ClassVar[str]
    """One of `CATEGORIES`: what the ranking trades (llm-d's scorer ``Category()``)."""

    @property
    def params(self) -> object:
        """The validated parameters it was built from (a frozen dataclass)."""
        ...

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """A fresh policy from its YAML parameters (absent ones take their defaults).

        Raises:
            PolicyConfigError: an unknown key, a value of the wrong type or out of range
                (the message names the parameter).
        """
        ...

    def decide(self, features: RequestFeatures, candidates: Sequence[Candidate],
               views: Sequence[BackendView], rng: random.Random) -> Decision:
        """Rank ``candidates`` (aligned with ``views``, same order, non-empty) best first."""
        ...


P = TypeVar("P")


def parse_params(policy: str, params_type: type[P], params: Mapping[str, Any]) -> P:
    """``params_type`` (a dataclass whose every field has a default) built from YAML parameters.

    The type a field takes is its default's type; an ``int`` is accepted for a ``float``
    field, a ``bool`` for neither. Range checks are the dataclass's own ``__post_init__``.

    Raises:
        PolicyConfigError: a key that is not a field, or a value of the wrong type (the
            message names the key); whatever ``__post_init__`` raises for a bad value.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(params_type)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key not in defaults:
            raise PolicyConfigError(f"policy {policy!r}: unknown parameter {key!r} (known: {sorted(defaults)})")
        kind = type(defaults[key])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PolicyConfigError(f"policy {policy!r}: parameter {key!r} must be {kind.__name__}, got {value!r}")
        values[key] = value
    return params_type(**values)


def params_reduce(params: object) -> tuple[type, tuple[Any, ...]]:
    """``__reduce__`` of a parameters dataclass: its class and field values, so that copying or
    pickling rebuilds it through its constructor. A frozen dataclass compiled by mypyc
    (`hot_path`) cannot be restored field by field (``copy.deepcopy`` of a policy would raise
    ``FrozenInstanceError``), as `router.cost.BackendSpec.__reduce__` says of its own."""
    return type(params), tuple(getattr(params, f.name) for f in dataclasses.fields(params))  # type: ignore[arg-type]


def require(policy: str, parameter: str, value: float, ok: bool, expected: str) -> None:
    """Raise PolicyConfigError naming ``parameter`` unless ``ok`` (and ``value`` is finite).

    Args:
        policy: the policy's name, for the message.
        parameter: the parameter's YAML key.
        value: its value (NaN and infinities are always rejected).
        ok: the parameter's range check on ``value``.
        expected: the range in words, e.g. ``"in [0, 1)"``.
    """
    if not (ok and math.isfinite(value)):
        raise PolicyConfigError(f"policy {policy!r}: {parameter} must be {expected}, got {value!r}")


def rank_by(candidates: Sequence[Candidate], keys: Sequence[float], rng: random.Random) -> tuple[Candidate, ...]:
    """Candidates sorted by ascending key, ties broken at random (reproducibly for the rng)."""
    jitter = [rng.random() for _ in candidates]
    order = sorted(range(len(candidates)), key=lambda i: (keys[i], jitter[i]))
    return tuple(candidates[i] for i in order)
