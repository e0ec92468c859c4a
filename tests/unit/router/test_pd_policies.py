"""The anchors' P/D rules (`pd-always`, `pd-llmd`, `pd-dynamo`) on hand-computed cases."""

from __future__ import annotations

import random

import pytest

from fleet_config.catalog import default_catalog
from router import kappa
from router.candidates import build_candidates
from router.cost import BackendSpec
from router.links import Interconnect, Link
from router.policies import build_policy
from router.policies.pd_dynamo import PdDynamoParams, kv_cost, prefill_remote
from router.policies.pd_llmd import PdLlmdParams, splits
from router.types import BackendView, PdFleet, RequestFeatures

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
BLOCK = 64.0
RDMA = Link.of(50, 0.0005, "rdma")
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
PD = PdFleet(ROLES, Interconnect(default=RDMA))


def features(prompt: int) -> RequestFeatures:
    return RequestFeatures("llama-3.1-8b", prompt, 64, prompt // int(BLOCK), BLOCK)


def view(backend_id: str, cached_blocks: int = 0, in_flight: int = 0, context_tokens: float = 0.0,
         waiting: int = 0) -> BackendView:
    return BackendView(backend_id, SPEC, matched_blocks=cached_blocks, hbm_blocks=cached_blocks, in_flight=in_flight,
                       context_tokens=context_tokens, kv_capacity_bytes=50e9, num_requests_waiting=waiting)


def decide_pd(name: str, feats: RequestFeatures, views: list[BackendView], pd: PdFleet = PD, **params: object):
    policy = build_policy(name, params)
    return policy.decide_pd(feats, build_candidates(feats, views), views, pd, random.Random(0))  # type: ignore[attr-defined]


@pytest.mark.parametrize(("non_cached", "minimum", "prompt", "cached", "split"), [
    (16, 0, 1_000, 0, True),
    (16, 0, 1_000, 984, True),   # 16 uncached: at the threshold, split (llm-d: < threshold stays)
    (16, 0, 1_000, 990, False),  # 10 uncached
    (0, 0, 1_000, 0, False),     # 0 disables the decider (llm-d's code default)
    (16, 2_000, 1_000, 0, False),  # below promptTokens
], ids=["cold", "at-threshold", "cached", "disabled", "short-prompt"])
def test_llmd_decider(non_cached: int, minimum: int, prompt: int, cached: int, split: bool) -> None:
    assert splits(PdLlmdParams(non_cached_tokens=non_cached, prompt_tokens=minimum), prompt, cached) is split


@pytest.mark.parametrize(("uncached", "queue", "remote"), [
    (1_001, 0, True), (1_000, 0, False), (5_000, 1, True), (5_000, 2, False)],
    ids=["long", "at-threshold", "queue-1", "queue-full"])
def test_dynamo_conditional_rule(uncached: int, queue: int, remote: bool) -> None:
    assert prefill_remote(PdDynamoParams(), uncached, queue) is remote


def test_dynamo_kv_cost_counts_blocks_to_prefill_and_active_blocks() -> None:
    feats = features(6_400)
    v = view("d0", cached_blocks=50, context_tokens=640.0)
    cand = build_candidates(feats, [v])[0]
    assert kv_cost(PdDynamoParams(), feats, cand, v) == pytest.approx(50 + 10)  # (6400 − 3200)/64 + 640/64
    assert kv_cost(PdDynamoParams(overlap_weight=2.0), feats, cand, v) == pytest.approx(110)


def test_pd_always_round_robin_takes_turns_in_each_pool_and_prices_the_transfer() -> None:
    feats = features(6_400)
    views = [view("p0"), view("p1"), view("d0", cached_blocks=25)]
    first = decide_pd("pd-always", feats, views, picker="round-robin")
    assert first.prefill is not None and first.prefill.candidate.backend_id == "p0" and first.chosen.backend_id == "d0"
    assert first.prefill.transfer_tokens == 6_400 - 25 * 64
    b_kv = kappa.model_constants(SPEC.model).kv_bytes(1)
    assert first.prefill.transfer_s == pytest.approx(0.0005 + 4_800 * b_kv / 50e9)
    policy = build_policy("pd-always", {"picker": "round-robin"})
    cands = build_candidates(feats, views)
    turns = [policy.decide_pd(feats, cands, views, PD, random.Random(0)).prefill.candidate.backend_id  # type: ignore
             for _ in range(3)]
    assert turns == ["p0", "p1", "p0"]


def test_pd_always_cache_aware_prefills_where_the_prefix_is() -> None:
    decision = decide_pd("pd-always", features(6_400), [view("p0", 10), view("p1", 60), view("d0")])
    assert decision.prefill is not None and decision.prefill.candidate.backend_id == "p1"


@pytest.mark.parametrize("name", ["pd-always", "pd-llmd", "pd-dynamo"])
def test_no_usable_link_never_splits(name: str) -> None:
    views = [view("p0"), view("p1"), view("d0")]
    broken = PdFleet(ROLES, Interconnect(default=RDMA), frozenset({("p0", "d0"), ("p1", "d0")}))
    for pd in (broken, PdFleet(ROLES, Interconnect())):
        decision = decide_pd(name, features(20_000), views, pd)
        assert decision.prefill is None and decision.chosen.backend_id == "d0"


def test_llmd_splits_only_a_long_uncached_suffix_on_the_decode_pod() -> None:
    cold = decide_pd("pd-llmd", features(6_400), [view("p0"), view("d0")])
    assert cold.prefill is not None and cold.prefill.candidate.backend_id == "p0"
    # d0 caches 99 of 100 blocks but the last token's block: 6400 − 6336 = 64 uncached ≥ 16, split
    assert decide_pd("pd-llmd", features(6_400), [view("p0"), view("d0", 99)]).prefill is not None
    assert decide_pd("pd-llmd", features(6_400), [view("p0"), view("d0", 99)], non_cached_tokens=100).prefill is None


def test_dynamo_keeps_prefill_local_when_the_prefill_queue_is_full() -> None:
    idle = [view("p0"), view("p1"), view("d0")]
    assert decide_pd("pd-dynamo", features(6_400), idle).prefill is not None
    busy = [view("p0", in_flight=3), view("p1", in_flight=1), view("d0")]  # queue 3 + 1 − 2 workers = 2
    assert decide_pd("pd-dynamo", features(6_400), busy).prefill is None
    assert decide_pd("pd-dynamo", features(900), idle).prefill is None  # short: local
    # the prefill worker is the cheaper one: p1 holds half the prompt
    assert decide_pd("pd-dynamo", features(6_400), [view("p0"), view("p1", 50), view("d0")]
                     ).prefill.candidate.backend_id == "p1"  # type: ignore[union-attr]
