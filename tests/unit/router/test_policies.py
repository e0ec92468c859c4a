"""Policies, table-driven over frozen snapshots (no event loop, no I/O)."""

from __future__ import annotations

import random

import pytest

from fleet_config.catalog import default_catalog
from router.cost import BackendSpec
from router.decide import decide
from router.errors import NoEligibleBackend
from router.policies import POLICY_NAMES, PolicyConfigError, build_policy
from router.policies.weighted import queue_scores
from router.types import BackendView, RequestFeatures

CATALOG = default_catalog()
MODEL = CATALOG.model("llama-3.1-8b")
B200 = BackendSpec(model=MODEL, hardware=CATALOG.hw("b200"))
GH200 = BackendSpec(model=MODEL, hardware=CATALOG.hw("gh200"))
H100_CAPPED = BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"), power_cap_w=400)
KV_CAPACITY = 50e9
BLOCK_TOKENS = 64.0


def features(prompt: int, max_tokens: int = 64) -> RequestFeatures:
    return RequestFeatures("llama-3.1-8b", prompt, max_tokens, int(prompt // BLOCK_TOKENS), BLOCK_TOKENS)


def view(bid: str, spec: BackendSpec = B200, **kw: object) -> BackendView:
    kw.setdefault("kv_capacity_bytes", KV_CAPACITY)
    return BackendView(bid, spec, **kw)


def chosen(policy: str, feats: RequestFeatures, views: list[BackendView], seed: int = 0, **params: object) -> str:
    return decide(build_policy(policy, params), feats, views, random.Random(seed)).chosen.backend_id


# -- kappa -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("feats", "views", "expected"),
    [
        # Long prompt, nothing cached anywhere: compute-dense B200 prefills fastest.
        (features(30_000), [view("b200"), view("gh200", GH200), view("h100", H100_CAPPED)], "b200"),
        # High κ: prefix in the host tier on B200 (PCIe) and GH200 (C2C): GH200 loads it faster.
        (features(40_000), [view("b200", host_blocks=600, matched_blocks=600),
                            view("gh200", GH200, host_blocks=600, matched_blocks=600)], "gh200"),
        # Prefix resident in HBM beats recomputing it on a faster GPU.
        (features(40_000), [view("b200"), view("h100", H100_CAPPED, hbm_blocks=600, matched_blocks=600)], "h100"),
        # Queued prefill work on B200 sends a cold request elsewhere.
        (features(8_000), [view("b200", outstanding_prefill_s=5.0), view("gh200", GH200)], "gh200"),
        # Memory-aware admission: B200's free KV cannot hold K+T+max_tokens.
        (features(30_000), [view("b200", kv_demand_bytes=KV_CAPACITY - 1e9), view("gh200", GH200)], "gh200"),
    ],
    ids=["compute-dense-for-cold", "bandwidth-rich-for-high-kappa", "hbm-hit-wins", "queue-aware", "admission"],
)
def test_kappa_policy(feats: RequestFeatures, views: list[BackendView], expected: str) -> None:
    assert chosen("kappa", feats, views) == expected


@pytest.mark.parametrize(("work_weight", "expected"), [(0.0, "idle"), (1.0, "holder")])
def test_kappa_charges_the_prefill_work_a_move_would_add(work_weight: float, expected: str) -> None:
    """A follow-up whose 38,400-token prefix is in HBM behind 1.2 s of queued prefill: recomputing it on
    an idle B200 (~1.05 s) gives a lower TTFT, at ~17× the prefill work, which later requests wait for."""
    views = [view("holder", hbm_blocks=600, matched_blocks=600, outstanding_prefill_s=1.2), view("idle")]
    assert chosen("kappa", features(40_000), views, work_weight=work_weight) == expected


@pytest.mark.parametrize(("in_flight_blocks", "expected"), [(0, "idle"), (600, "holder")])
def test_kv_held_by_requests_in_flight_is_not_charged_twice(in_flight_blocks: int, expected: str) -> None:
    """38,400 prefix tokens in HBM, 1 GB of KV left by the ledger: the follow-up needs 40,064 tokens × 131,072 B
    = 5.25 GB if its prefix is charged again, 1,664 tokens = 0.22 GB if requests in flight there already hold it."""
    holder = view("holder", hbm_blocks=600, matched_blocks=600, in_flight_blocks=in_flight_blocks,
                  kv_demand_bytes=KV_CAPACITY - 1e9)
    decision = decide(build_policy("kappa"), features(40_000), [holder, view("idle")], random.Random(0))
    assert decision.chosen.backend_id == expected
    charged = next(c for c in decision.ranked if c.backend_id == "holder").estimate.kv_demand_bytes
    assert charged == (1_664 if in_flight_blocks else 40_064) * 131_072


def test_kappa_ties_go_to_lower_energy() -> None:
    # Tiny request: both finish within the tie band; the capped H100 draws less.
    views = [view("b200"), view("h100", H100_CAPPED)]
    decision = decide(build_policy("kappa", {"energy_tie_ratio": 0.99}), features(16), views, random.Random(0))
    assert decision.chosen.estimate.energy_j <= decision.ranked[1].estimate.energy_j


def test_kappa_without_room_anywhere_still_ranks_everyone() -> None:
    views = [view("a", kv_demand_bytes=KV_CAPACITY), view("b", GH200, kv_demand_bytes=KV_CAPACITY)]
    decision = decide(build_policy("kappa"), features(1_000), views, random.Random(0))
    assert len(decision.ranked) == 2 and not decision.chosen.admitted
    assert "no backend had free KV memory" in decision.reason


def test_candidates_cap_hits_at_prompt_minus_one_and_split_tiers() -> None:
    views = [view("a", hbm_blocks=10, host_blocks=10, matched_blocks=20)]
    decision = decide(build_policy("kappa"), features(1_280), views, random.Random(0))
    c = decision.chosen
    assert (c.cached_hbm_tokens, c.cached_host_tokens, c.uncached_prompt_tokens) == (640, 639, 1)
    assert c.estimate.kappa_ratio == 1_279


# -- round-robin, least-loaded -----------------------------------------------------------
def test_round_robin_cycles_in_config_order() -> None:
    policy = build_policy("round-robin")
    views = [view("a"), view("b"), view("c")]
    picks = [decide(policy, features(100), views, random.Random(0)).chosen.backend_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


@pytest.mark.parametrize(
    ("loads", "expected"), [([3, 1, 2], "b"), ([0, 5, 5], "a"), ([2, 2, 0], "c")], ids=["middle", "first", "last"])
def test_least_loaded(loads: list[int], expected: str) -> None:
    views = [view(b, in_flight=n) for b, n in zip("abc", loads, strict=True)]
    assert chosen("least-loaded", features(100), views) == expected


def test_least_loaded_breaks_ties_at_random() -> None:
    views = [view("a"), view("b")]
    assert {chosen("least-loaded", features(100), views, seed=s) for s in range(20)} == {"a", "b"}


# -- prefix-affinity (SGLang cache_aware) ------------------------------------------------
@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([view("a", in_flight=100), view("b", in_flight=10, hbm_blocks=150, matched_blocks=150)], "b"),
        ([view("a", in_flight=100, hbm_blocks=150, matched_blocks=150), view("b", in_flight=10)], "b"),
        ([view("a", in_flight=5, hbm_blocks=150, matched_blocks=150), view("b", in_flight=0)], "a"),
        ([view("a", cached_blocks=900, hbm_blocks=10, matched_blocks=10), view("b", cached_blocks=100)], "b"),
    ],
    ids=["imbalanced-least-loaded", "imbalance-beats-affinity", "match-above-threshold", "low-match-smallest-tree"],
)
def test_prefix_affinity(views: list[BackendView], expected: str) -> None:
    assert chosen("prefix-affinity", features(10_000), views) == expected


# -- weighted (llm-d) --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("waiting", "expected"), [([], []), ([3, 3], [1.0, 1.0]), ([0, 10, 5], [1.0, 0.0, 0.5])],
    ids=["empty", "equal", "spread"])
def test_queue_scores(waiting: list[int], expected: list[float]) -> None:
    assert (queue_scores(waiting) if waiting else []) == expected


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([view("a", matched_blocks=150), view("b")], "a"),
        ([view("a", matched_blocks=50, num_requests_waiting=10), view("b", num_requests_waiting=0)], "b"),
        ([view("a", kv_cache_usage_ratio=0.95), view("b", kv_cache_usage_ratio=0.1)], "b"),
        ([view("a", kv_cache_usage_ratio=1.7), view("b", kv_cache_usage_ratio=-1)], "b"),
    ],
    ids=["prefix", "queue-beats-weak-prefix", "kv-usage", "clamped"],
)
def test_weighted(views: list[BackendView], expected: str) -> None:
    assert chosen("weighted", features(10_000), views) == expected


# -- construction ------------------------------------------------------------------------
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_builds_and_ranks_all_candidates(name: str) -> None:
    views = [view("a"), view("b", GH200), view("c", H100_CAPPED)]
    decision = decide(build_policy(name), features(2_000), views, random.Random(1))
    assert sorted(c.backend_id for c in decision.ranked) == ["a", "b", "c"] and decision.policy == name


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [("fastest", {}, "unknown policy 'fastest'"), ("kappa", {"energy_tie": 0.1}, "unknown parameter 'energy_tie'"),
     ("weighted", {"prefix_weight": "3"}, "must be float"), ("prefix-affinity", {"cache_threshold_fraction": 2.0}, "cache_threshold_fraction"),
     ("kappa", {"energy_tie_ratio": 1.5}, "energy_tie_ratio"), ("kappa", {"work_weight": -1.0}, "work_weight")],
    ids=["unknown-policy", "unknown-param", "wrong-type", "out-of-range", "kappa-range", "kappa-work-weight"],
)
def test_bad_policy_config_names_the_problem(name: str, params: dict, message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        build_policy(name, params)


def test_no_views_is_no_eligible_backend() -> None:
    with pytest.raises(NoEligibleBackend, match="llama-3.1-8b"):
        decide(build_policy("kappa"), features(10), [], random.Random(0))


def test_backends_too_small_for_the_request_are_left_out_unless_none_fits() -> None:
    small = view("small", kv_capacity_bytes=1e9)  # 1 GB ≈ 7,600 tokens of Llama-3.1-8B KV
    big = view("big", GH200, kv_capacity_bytes=50e9)
    ranked = decide(build_policy("round-robin"), features(20_000), [small, big], random.Random(0)).ranked
    assert [c.backend_id for c in ranked] == ["big"]
    both_small = [small, view("small2", kv_capacity_bytes=1e9)]
    ranked = decide(build_policy("round-robin"), features(20_000), both_small, random.Random(0)).ranked
    assert len(ranked) == 2


# -- kappa: energy breaks near-ties ----------------------------------------------------------
H100 = BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"))
H100_650W = BackendSpec(model=MODEL, hardware=CATALOG.hw("h100-sxm"), power_cap_w=650)


@pytest.mark.parametrize(("energy_tie_ratio", "expected"), [(0.05, "capped"), (0.0, "full")],
                         ids=["within-the-band-lower-energy-wins", "no-band-lower-score-wins"])
def test_kappa_policy_breaks_a_near_tie_by_energy(energy_tie_ratio: float, expected: str) -> None:
    """A 650 W cap leaves an H100 ~2.7% slower ((580/630)^(1/3) of its clocks) at 93% of the
    power: its score is within 5% of the full-power one's and its energy is lower."""
    feats = features(8_000)
    views = [view("full", H100), view("capped", H100_650W)]
    policy = build_policy("kappa", {"energy_tie_ratio": energy_tie_ratio})
    decision = decide(policy, feats, views, random.Random(0))
    by_id = {c.backend_id: c for c in decision.ranked}
    full, capped = by_id["full"], by_id["capped"]
    assert policy.score(full) < policy.score(capped) <= policy.score(full) * 1.05  # a near-tie
    assert capped.estimate.energy_j < full.estimate.energy_j
    assert decision.chosen.backend_id == expected
