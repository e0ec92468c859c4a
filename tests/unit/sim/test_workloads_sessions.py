"""The generated workloads' shapes and statistics, the registry, and the infinite-cache shared prefix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from statistics import median

import pytest

from sim.traces import TraceRequest, load_azure
from sim.workloads import WORKLOADS, build_workload, shareable_prefix_tokens
from sim.workloads.agentic import AGENT_SYSTEM_TOKENS, agentic_coding
from sim.workloads.chat import CHAT_SYSTEM_TOKENS, DEFAULT_WINDOW_TOKENS, multi_turn_chat
from sim.workloads.document_qa import DOC_MAX_TOKENS, DOC_MIN_TOKENS, DOC_SYSTEM_TOKENS, document_qa
from sim.workloads.sessions import BLOCK_TOKENS


def kappa_ratios(requests: list[TraceRequest]) -> list[float]:
    """κ_ratio = K/T with an infinite fleet-wide cache, hits capped at P − 1."""
    out = []
    for req, shared in zip(requests, shareable_prefix_tokens(requests), strict=True):
        cached = min(shared, req.input_tokens - 1)
        out.append(cached / (req.input_tokens - cached))
    return out


def hit_ratio(requests: list[TraceRequest]) -> float:
    shared = shareable_prefix_tokens(requests)
    return sum(min(s, r.input_tokens - 1) for s, r in zip(shared, requests, strict=True)) / sum(
        r.input_tokens for r in requests)


def test_shareable_prefix_counts_whole_earlier_blocks_and_partial_tails() -> None:
    trace = [
        TraceRequest(0.0, 1_000, 1, (1, 2)),  # 512 + 488 (block 2 partial)
        TraceRequest(1.0, 1_200, 1, (1, 2, 3)),  # block 1 whole; block 2 only 488 tokens seen
        TraceRequest(2.0, 1_536, 1, (1, 2, 3)),  # 1 and 2 whole (request 1), 3 held 176 of 512
        TraceRequest(3.0, 700, 1, (9, 2)),  # a different first block: nothing
        TraceRequest(4.0, 700, 1, ()),  # no ids: nothing
    ]
    assert shareable_prefix_tokens(trace) == [0, 512 + 488, 1024 + 176, 0, 0]
    # Arrival order decides, not list order.
    assert shareable_prefix_tokens(list(reversed(trace[:2]))) == [512 + 488, 0]


def test_document_qa_has_few_long_documents_and_kappa_in_the_thousands() -> None:
    requests = document_qa(1_500, rate_rps=2.0, seed=3)
    documents = {r.hash_ids[1] for r in requests}
    assert len(documents) == 12
    doc_tokens = [r.input_tokens - DOC_SYSTEM_TOKENS for r in requests]
    assert all(DOC_MIN_TOKENS < t <= DOC_MAX_TOKENS + BLOCK_TOKENS for t in doc_tokens)
    assert all(r.hash_ids[0] == 0 for r in requests)  # the shared instructions
    assert median(kappa_ratios(requests)) > 1_000
    assert hit_ratio(requests) > 0.99
    assert median(r.output_tokens for r in requests) < 150
    assert len(requests) / requests[-1].arrival_s == pytest.approx(2.0, rel=0.1)


def test_agentic_contexts_are_long_append_only_and_high_kappa() -> None:
    requests = agentic_coding(1_500, rate_rps=2.0, seed=1)
    assert median(r.input_tokens for r in requests) > 20_000
    assert all(r.input_tokens + r.output_tokens <= 120_000 for r in requests)
    assert all(r.hash_ids[: AGENT_SYSTEM_TOKENS // BLOCK_TOKENS] == tuple(range(16)) for r in requests)
    shared = shareable_prefix_tokens(requests)
    # Append-only: a follow-up shares every whole block of some earlier prompt (≥ the system prompt).
    assert sum(s > AGENT_SYSTEM_TOKENS for s in shared) / len(requests) > 0.85
    assert hit_ratio(requests) > 0.85
    assert 10 < median(kappa_ratios(requests)) < 100
    assert len(requests) / requests[-1].arrival_s == pytest.approx(2.0, rel=0.25)


def test_a_sliding_window_collapses_the_prefix_reuse_of_the_same_chats() -> None:
    whole = multi_turn_chat(2_000, rate_rps=4.0, seed=2)
    windowed = multi_turn_chat(2_000, rate_rps=4.0, seed=2, window_tokens=DEFAULT_WINDOW_TOKENS)
    # The same conversations: same arrivals and answers, prompts only cut.
    assert [(r.arrival_s, r.output_tokens) for r in whole] == [(r.arrival_s, r.output_tokens) for r in windowed]
    assert all(w.input_tokens <= min(c.input_tokens, DEFAULT_WINDOW_TOKENS) for w, c in zip(windowed, whole))
    truncated = sum(w.input_tokens < c.input_tokens for w, c in zip(windowed, whole)) / len(whole)
    assert truncated > 0.5
    assert all(r.hash_ids[:2] == (0, 1) for r in whole + windowed)  # the shared system prompt
    assert hit_ratio(whole) > 0.8
    assert hit_ratio(windowed) < 0.6 * hit_ratio(whole)
    assert median(kappa_ratios(windowed)) < median(kappa_ratios(whole)) / 5
    # A truncated turn that moved its window finds the system prompt only.
    shared = shareable_prefix_tokens(windowed)
    assert sum(s == CHAT_SYSTEM_TOKENS for s in shared) / len(shared) > 0.4


@pytest.mark.parametrize("name", [n for n, w in WORKLOADS.items() if not w.real])
def test_generated_workloads_are_deterministic_per_seed(name: str) -> None:
    once = build_workload(name, 60, seed=5)
    assert once == build_workload(name, 60, seed=5)
    assert once != build_workload(name, 60, seed=6)
    assert len(once) == 60
    assert [r.arrival_s for r in once] == sorted(r.arrival_s for r in once)
    assert all(len(r.hash_ids) == -(-r.input_tokens // BLOCK_TOKENS) for r in once)


def test_unknown_workload_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build_workload("nope", 10)
    with pytest.raises(ValueError, match="window_tokens"):
        multi_turn_chat(10, rate_rps=1.0, window_tokens=1_000)
    for generate in (multi_turn_chat, agentic_coding, document_qa):
        with pytest.raises(ValueError):
            generate(10, rate_rps=0)


def test_azure_workload_is_the_real_trace_without_prefixes(real_trace: Callable[[str], Path]) -> None:
    conv = real_trace("azure-conv")  # skips where it is absent
    requests = build_workload("azure-conv", 500)
    assert requests == load_azure(conv, limit=500)
    assert requests[0].arrival_s == 0.0 and all(r.hash_ids == () for r in requests)
    assert hit_ratio(requests) == 0.0
    real_trace("azure-code")  # skips where it is absent
    assert len(build_workload("azure-code", 100)) == 100


def test_real_mooncake_workload(real_trace: Callable[[str], Path]) -> None:
    real_trace("mooncake")  # skips where it is absent
    requests = build_workload("mooncake", 2_000)
    assert len(requests) == 2_000 and all(r.hash_ids[0] == 0 for r in requests)
    assert 0.2 < hit_ratio(requests) < 0.5
