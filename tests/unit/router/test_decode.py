"""The decode a request joins (`router.decode`): the step against the mock engine's own, the batch
from the ledger and the scrape, the interference, and the κ policy's E2E objective."""

from __future__ import annotations

import random

import pytest

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.types import EngineConfig
from router import kappa
from router.candidates import build_candidates
from router.cost import BackendSpec
from router.decide import decide
from router.decode import decode_step_s, estimate_decode
from router.policies import PolicyConfigError, build_policy
from router.types import BackendView, RequestFeatures

CATALOG = default_catalog()
MODEL = CATALOG.model("llama-3.1-70b")
B200 = BackendSpec(model=MODEL, hardware=CATALOG.hw("b200"), tensor_parallel=2)
KV_CAPACITY = 400e9
BLOCK_TOKENS = 64.0


def features(prompt: int, max_tokens: int = 300) -> RequestFeatures:
    return RequestFeatures("llama-3.1-70b", prompt, max_tokens, int(prompt // BLOCK_TOKENS), BLOCK_TOKENS)


def view(bid: str, spec: BackendSpec = B200, **kw: object) -> BackendView:
    kw.setdefault("kv_capacity_bytes", KV_CAPACITY)
    return BackendView(bid, spec, **kw)


def decode_of(feats: RequestFeatures, v: BackendView):
    [candidate] = build_candidates(feats, [v])
    return candidate, estimate_decode(feats, candidate.estimate, v)


def test_the_decode_step_is_the_mock_engines_step() -> None:
    """Eight requests of 600 to 1,300 prompt tokens (8,000 in all: one step's token budget) prefilled
    together on the mock engine; its next step decodes all eight, and lasts what `decode_step_s`
    predicts for 8 sequences and their summed context (the one roofline both use; the engine
    attends each token to context + ½, the router to context)."""
    engine = MockEngine(B200, EngineConfig())
    prompts = [600 + 100 * i for i in range(8)]
    for i, n in enumerate(prompts):
        engine.add_request(f"r{i}", [7 + i] * n, max_tokens=50, arrival_s=0.0)
    prefill = engine.step(0.0)
    assert prefill.num_prefill_tokens == sum(prompts) and len(prefill.outputs) == 8
    step = engine.step(prefill.end_s)
    assert step.num_prefill_tokens == 0 and step.num_decode_tokens == 8
    assert step.duration_s == pytest.approx(decode_step_s(B200, 8, sum(prompts)), rel=1e-3)


def test_alone_the_decode_is_the_batch_of_one() -> None:
    """Nothing in flight: ITL is one sequence's step at P + max_tokens/2, decode (o − 1) of them, no interference."""
    feats = features(10_000)
    candidate, dec = decode_of(feats, view("idle"))
    assert dec.batch_requests == 0 and dec.interference_s == 0.0
    assert dec.itl_s == pytest.approx(decode_step_s(B200, 1, 10_000 + 150))
    assert dec.decode_s == pytest.approx(299 * dec.itl_s)
    assert dec.e2e_s == pytest.approx(candidate.estimate.ttft_s + dec.decode_s)


def test_a_busy_batch_slows_the_request_and_it_slows_the_batch() -> None:
    """40 requests in flight holding 400k tokens of context and 12,000 output tokens: the step with this
    request is longer than alone, and it adds to the others their stall on its prefill (40 × prefill)
    plus its share of every step they run beside it (overlap min(40 × 300, 12,000 / 2) = 6,000 tokens)."""
    feats = features(10_000)
    busy = view("busy", in_flight=40, context_tokens=400_000.0, output_tokens=12_000.0)
    candidate, dec = decode_of(feats, busy)
    _, alone = decode_of(feats, view("idle"))
    before = decode_step_s(B200, 40, 400_000.0)
    assert dec.itl_s == pytest.approx(decode_step_s(B200, 41, 410_150.0)) and dec.itl_s > alone.itl_s
    expected = 40 * candidate.estimate.prefill_s + (dec.itl_s - before) * 6_000
    assert dec.interference_s == pytest.approx(expected)
    assert dec.batch_requests == 40


def test_requests_the_scrape_saw_beyond_the_ledger_join_the_batch_at_its_mean_context() -> None:
    feats = features(10_000)
    _, dec = decode_of(feats, view("b", in_flight=10, context_tokens=100_000.0, foreign_requests=30))
    assert dec.batch_requests == 40
    assert dec.itl_s == pytest.approx(decode_step_s(B200, 41, 400_000.0 + 10_150.0))


def test_kv_bytes_per_sequence_for_sliding_window_models() -> None:
    """A model with sliding-window layers holds at most the window per sequence: two sequences of
    100k tokens read 2 × kv_bytes(100k), not kv_bytes(200k) (the window would be counted once)."""
    gpt_oss = CATALOG.model("gpt-oss-20b")
    spec = BackendSpec(model=gpt_oss, hardware=CATALOG.hw("b200"))
    c = kappa.model_constants(gpt_oss)
    assert c.window_tokens > 0
    hbm = c.weights_read_bytes(2) + 2 * c.kv_bytes(100_000)
    assert decode_step_s(spec, 2, 200_000) >= hbm / spec.hbm_bandwidth_bytes_per_s


# -- the κ policy's objective -----------------------------------------------------------------
def test_e2e_objective_leaves_the_backend_whose_decode_batch_it_would_stall() -> None:
    """Two B200 pairs: one with 0.3 s less queued prefill but 60 requests decoding 20k-token contexts.
    Greedy TTFT takes it; the E2E objective (the default) goes to the quiet one, whose decode is faster
    and where its 10k-token prefill stalls nobody."""
    feats = features(10_000)
    views = [view("busy", in_flight=60, context_tokens=60 * 20_150.0, output_tokens=60 * 300.0),
             view("quiet", outstanding_prefill_s=0.3)]
    ttft = build_policy("kappa", {"decode_weight": 0.0, "interference_weight": 0.0})
    assert decide(ttft, feats, views, random.Random(0)).chosen.backend_id == "busy"
    decision = decide(build_policy("kappa"), feats, views, random.Random(0))
    assert decision.chosen.backend_id == "quiet"
    assert "least predicted E2E" in decision.reason and "batch of 0" in decision.reason


def test_a_ttft_slo_ranks_the_candidates_within_it_first() -> None:
    """Only 'busy' is predicted to start within an SLO 0.3 s past its prefill (quiet has 0.6 s of queue):
    with the SLO it ranks first, whatever its E2E."""
    feats = features(10_000)
    views = [view("busy", in_flight=60, context_tokens=60 * 20_150.0, output_tokens=60 * 300.0),
             view("quiet", outstanding_prefill_s=0.6)]
    assert decide(build_policy("kappa"), feats, views, random.Random(0)).chosen.backend_id == "quiet"
    slo = build_candidates(feats, views[:1])[0].estimate.ttft_s + 0.3
    decision = decide(build_policy("kappa", {"ttft_slo_s": slo}), feats, views, random.Random(0))
    assert [c.backend_id for c in decision.ranked] == ["busy", "quiet"]


@pytest.mark.parametrize("bad", [{"decode_weight": -1.0}, {"interference_weight": float("nan")},
                                 {"ttft_slo_s": -0.1}, {"ttft_weight": 0.0, "decode_weight": 0.0,
                                                         "work_weight": 0.0, "interference_weight": 0.0}])
def test_bad_objective_weights_are_refused_by_name(bad: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError, match=next(iter(bad))):
        build_policy("kappa", bad)
