"""Routing policies, one per module, chosen by name in the gateway config (``routing.policy``).

Each module follows one shape (`router.policies.base`): a kebab-case ``name``, a
``category``, a frozen parameters dataclass that validates itself, and the factory
``from_params``. The registry is this fixed table, built once at import.

| name | module | category |
| --- | --- | --- |
| ``kappa`` (default) | `router.policies.kappa` | cost: least predicted E2E + what it costs others, memory-aware; splits P/D when it pays |
| ``kappa-aggregated`` | `router.policies.kappa` | cost: ``kappa`` that never splits a request (P/D fleets) |
| ``round-robin`` | `router.policies.round_robin` | distribution |
| ``least-loaded`` | `router.policies.least_loaded` | distribution |
| ``prefix-affinity`` | `router.policies.prefix_affinity` | affinity (SGLang cache_aware) |
| ``weighted`` | `router.policies.weighted` | affinity + distribution (llm-d default scorers) |
| ``pd-always`` | `router.policies.pd_always` | affinity: always split P/D (SGLang; production-stack with ``picker: round-robin``) |
| ``pd-llmd`` | `router.policies.pd_llmd` | affinity + distribution: llm-d's prefix-based P/D decider |
| ``pd-dynamo`` | `router.policies.pd_dynamo` | affinity + distribution: Dynamo's conditional disaggregation |

The ``pd-*`` policies share `router.policies.pd_split` (pools, a split made into a decision).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from router.policies.base import CATEGORIES, Policy, PolicyConfigError
from router.policies.kappa import KappaAggregatedPolicy, KappaPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.pd_always import PdAlwaysPolicy
from router.policies.pd_dynamo import PdDynamoPolicy
from router.policies.pd_llmd import PdLlmdPolicy
from router.policies.prefix_affinity import PrefixAffinityPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.weighted import WeightedPolicy

POLICY_CLASSES: tuple[type[Policy], ...] = (
    KappaPolicy, KappaAggregatedPolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixAffinityPolicy, WeightedPolicy,
    PdAlwaysPolicy, PdLlmdPolicy, PdDynamoPolicy)
POLICY_TYPES: Mapping[str, type[Policy]] = MappingProxyType({cls.name: cls for cls in POLICY_CLASSES})
POLICY_NAMES = tuple(POLICY_TYPES)


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A fresh policy object from its config name and parameters.

    Raises:
        PolicyConfigError: unknown name, unknown parameter or bad value (the message names it).
    """
    try:
        cls = POLICY_TYPES[name]
    except KeyError:
        raise PolicyConfigError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})") from None
    return cls.from_params(params or {})


__all__ = ["CATEGORIES", "POLICY_CLASSES", "POLICY_NAMES", "POLICY_TYPES", "Policy", "PolicyConfigError",
           "build_policy"]
