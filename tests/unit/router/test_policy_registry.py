"""Every registered policy has the plugin shape of `router.policies.base`, checked from the registry.

Parametrized over `router.policies.POLICY_CLASSES` (so a new policy is checked without editing
this file): it has the protocol's members, builds from no parameters, names an unknown key,
and rejects a bad value of each of its parameters by that parameter's name.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import random
import re
from typing import Any

import pytest

from fleet_config.catalog import default_catalog
from router.cost import BackendSpec
from router.decide import decide
from router.policies import CATEGORIES, POLICY_CLASSES, POLICY_NAMES, POLICY_TYPES, Policy, PolicyConfigError
from router.types import BackendView, RequestFeatures

KEBAB = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
CATALOG = default_catalog()
MODEL = CATALOG.model("llama-3.1-8b")

POLICIES = pytest.mark.parametrize("cls", POLICY_CLASSES, ids=[cls.name for cls in POLICY_CLASSES])


# The members of `router.policies.base.Policy`: two class attributes, the factory, the
# validated parameters and the ranking. Listed here because a mypyc-compiled Protocol keeps its
# methods but not its class annotations; the first test checks the list against the protocol.
PROTOCOL_MEMBERS = ("category", "decide", "from_params", "name", "params")


def _declared_members() -> set[str]:
    names = set(vars(Policy)) | set(getattr(Policy, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def _params_type(cls: type[Policy]) -> Any:
    params = cls.from_params({}).params
    assert dataclasses.is_dataclass(params)
    return type(params)


def _bad_values(default: object) -> list[object]:
    """Values every parameter must refuse: the wrong type, a bool, a negative, NaN and ∞ for floats."""
    bad: list[object] = ["1", True, None, -1 if isinstance(default, int) else -1.0]
    if isinstance(default, float):
        bad += [float("nan"), float("inf")]
    return bad


def _params_cases() -> list[Any]:
    cases = []
    for cls in POLICY_CLASSES:
        for field in dataclasses.fields(_params_type(cls)):
            for value in _bad_values(field.default):
                cases.append(pytest.param(cls, field.name, value, id=f"{cls.name}-{field.name}-{value!r}"))
    return cases


def test_the_protocol_has_the_members_this_file_checks() -> None:
    declared = _declared_members()
    assert {"decide", "from_params", "params"} <= declared <= set(PROTOCOL_MEMBERS)


@POLICIES
def test_policy_has_the_protocol_members(cls: type[Policy]) -> None:
    policy = cls.from_params({})
    for member in PROTOCOL_MEMBERS:
        assert hasattr(policy, member), f"{cls.__name__} has no {member}"
    assert isinstance(cls.name, str) and cls.category in CATEGORIES
    assert cls.from_params.__self__ is cls  # a classmethod (bound to the class, compiled or not)
    assert list(inspect.signature(cls.decide).parameters) == ["self", "features", "candidates", "views", "rng"]


@POLICIES
def test_from_no_params_builds_it_with_its_defaults(cls: type[Policy]) -> None:
    policy = cls.from_params({})
    assert type(policy) is cls
    params_type = _params_type(cls)
    assert policy.params == params_type()
    fields = dataclasses.fields(params_type)
    assert all(f.default is not dataclasses.MISSING for f in fields)
    for field in fields:
        with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
            setattr(policy.params, field.name, field.default)


@POLICIES
def test_a_policy_copies_and_pickles_with_its_parameters(cls: type[Policy]) -> None:
    """The dispatcher deep-copies the policy for a dry run (`/v1/kappa/route`): a frozen dataclass
    compiled by mypyc raised FrozenInstanceError there until the parameters had a ``__reduce__``."""
    policy = cls.from_params({})
    assert copy.deepcopy(policy).params == policy.params
    assert pickle.loads(pickle.dumps(policy.params)) == policy.params


@POLICIES
def test_built_from_no_params_it_ranks_every_candidate(cls: type[Policy]) -> None:
    spec = BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"))
    views = [BackendView(b, spec, kv_capacity_bytes=50e9) for b in "ab"]
    features = RequestFeatures("llama-3.1-8b", 1_000, 64, 15, 64.0)
    decision = decide(cls.from_params({}), features, views, random.Random(0))
    assert sorted(c.backend_id for c in decision.ranked) == ["a", "b"] and decision.policy == cls.name


@POLICIES
def test_an_unknown_key_is_rejected_by_its_name(cls: type[Policy]) -> None:
    with pytest.raises(PolicyConfigError, match=rf"policy '{cls.name}': unknown parameter 'no_such_knob'"):
        cls.from_params({"no_such_knob": 1})


@pytest.mark.parametrize(("cls", "parameter", "value"), _params_cases())
def test_each_parameter_rejects_a_bad_value_by_its_name(cls: type[Policy], parameter: str, value: object) -> None:
    with pytest.raises(PolicyConfigError, match=rf"policy '{cls.name}': (parameter )?'?{parameter}'? must"):
        cls.from_params({parameter: value})


@POLICIES
def test_each_parameter_takes_its_default_given_explicitly(cls: type[Policy]) -> None:
    params_type = _params_type(cls)
    explicit = {f.name: f.default for f in dataclasses.fields(params_type)}
    assert cls.from_params(explicit).params == params_type()


def test_names_are_kebab_case_and_unique() -> None:
    names = [cls.name for cls in POLICY_CLASSES]
    assert all(KEBAB.fullmatch(n) for n in names), names
    assert len(set(names)) == len(names)
    assert list(POLICY_TYPES) == list(POLICY_NAMES) == names
    assert all(POLICY_TYPES[cls.name] is cls for cls in POLICY_CLASSES)
