"""What ``kappa-gateway analyze`` computes (issue 27, item 7): the chat workloads with their messages,
the hit a workload allows, a host tier's LRU hit, and prefix invalidation offline.

The attribution test makes the live test's comparison (``tests/integration/test_prefix_invalidation.py``)
on the analysis's own figures: over the requests that continue a conversation seen earlier in the
trace, the windowed chat's uncached tokens minus the whole chat's (each with the hit an infinite
shared cache allows) is the re-prefill the window costs; the detector must put ≥ 90% of it, and
no more than 110%, down to front truncation, and count nothing on the whole chat.
"""

from __future__ import annotations

import pytest

from fleet_config import default_catalog
from gateway.commands.analyze import fp8_kv, respec
from router.cost import BackendSpec, RequestShape, predict
from router.kappa import Regime
from sim.analysis import host_tier_tokens, prompt_views, regime_figures, shareable_tokens
from sim.traces import TraceRequest
from sim.workloads import build_workload, shareable_prefix_tokens
from sim.workloads.chat import CHAT_SYSTEM_TOKENS

MODEL = "llama-3.1-70b"
REQUESTS = 1_500


@pytest.fixture(scope="module")
def chats() -> dict[str, list[TraceRequest]]:
    return {name: build_workload(name, REQUESTS, seed=4, messages=True) for name in ("chat", "chat-sliding-window")}


def test_chat_messages_are_the_records_with_their_chats(chats: dict[str, list[TraceRequest]]) -> None:
    whole, window = chats["chat"], chats["chat-sliding-window"]
    plain = build_workload("chat-sliding-window", REQUESTS, seed=4)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids) for r in window] == [
        (r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids) for r in plain]
    for w, c in zip(window, whole, strict=True):
        assert w.session_id == c.session_id
        assert sum(len(m["content"]) // 4 for m in w.messages) == w.input_tokens  # one " abc" word a token
        assert w.messages[0] == c.messages[0] and w.messages[0]["role"] == "system"
        dropped = len(c.messages) - len(w.messages)
        assert dropped % 2 == 0 and w.messages[1:] == c.messages[1 + dropped:]  # the oldest pairs gone
    with pytest.raises(ValueError, match="no chat messages"):
        build_workload("document-qa", 10, messages=True)


def test_hit_allowed_on_trace_blocks_is_the_sessions_figure() -> None:
    trace = build_workload("agentic-coding", 300, seed=1)
    views = prompt_views(trace, model=MODEL)
    capped = [min(s, max(r.input_tokens - 1, 0)) for s, r in zip(shareable_prefix_tokens(trace), trace)]
    assert shareable_tokens(views) == capped
    assert all(v.finding is None for v in views)  # hash ids cannot show a rewritten context


def test_a_host_tier_holds_less_than_the_infinite_cache(chats: dict[str, list[TraceRequest]]) -> None:
    views = prompt_views(chats["chat"], model=MODEL)
    allowed = shareable_tokens(views)
    hits = {cap: sum(host_tier_tokens(views, cap)) for cap in (0.0, 2e5, 2e6, float("inf"))}
    assert hits[0.0] == 0 and hits[float("inf")] == sum(allowed)
    assert hits[0.0] < hits[2e5] < hits[2e6] <= hits[float("inf")]


def _uncached(views: list, allowed: list[int]) -> list[int]:
    return [v.prompt_tokens - k for v, k in zip(views, allowed)]


def test_sliding_window_loss_is_attributed_to_front_truncation(chats: dict[str, list[TraceRequest]]) -> None:
    whole = prompt_views(chats["chat"], model=MODEL)
    window = prompt_views(chats["chat-sliding-window"], model=MODEL)
    assert sum(v.finding.invalidated_tokens for v in whole) == 0
    assert all(v.finding.cause is None for v in whole)
    seen: set[str | None] = set()
    loss = counted = 0
    for w, c, uw, uc in zip(window, whole, _uncached(window, shareable_tokens(window)),
                            _uncached(whole, shareable_tokens(whole)), strict=True):
        if w.session_id in seen:
            loss += uw - uc
            counted += w.finding.invalidated_tokens if w.finding.cause == "front_truncation" else 0
        seen.add(w.session_id)
    assert {v.finding.cause for v in window} == {None, "front_truncation"}
    assert 0.9 <= counted / loss <= 1.1, counted / loss
    # Where the window moved, a continuing turn's hit is the system prompt's (and a header byte or so).
    moved = [k for v, k in zip(window, shareable_tokens(window)) if v.finding.cause == "front_truncation"]
    assert all(CHAT_SYSTEM_TOKENS - 64 <= k <= CHAT_SYSTEM_TOKENS + 64 for k in moved)


def test_regime_figures_and_the_fp8_and_link_what_ifs() -> None:
    catalog = default_catalog()
    spec = BackendSpec(model=catalog.model(MODEL), hardware=catalog.hw("h100-sxm"))  # κ_crit_linear ≈ 14.6
    cached, prompts, outputs = [0, 9_000, 60_000], [1_000, 10_000, 61_000], [1, 1, 1]
    base = regime_figures(cached, prompts, outputs, spec)
    assert base.requests == 3 and base.hit_ratio == pytest.approx(69_000 / 72_000)
    # K/T = 0, 9 and 60 against a κ_crit of ~15 at T = 1000 over PCIe: only the last loads longer than it computes.
    regimes = [predict(RequestShape(0, k, p - k, 1), spec).regime for k, p in zip(cached, prompts)]
    assert regimes == [Regime.COMPUTE, Regime.COMPUTE, Regime.TRANSFER]
    assert base.transfer_bound_share == pytest.approx(1 / 3)
    assert base.kappa_ratio["p50"] == pytest.approx(9.0)
    fp8 = regime_figures(cached, prompts, outputs, fp8_kv(spec))
    fast = regime_figures(cached, prompts, outputs, respec(spec, host_link_gb_s=300.0))
    assert fp8.transfer_bound_share <= base.transfer_bound_share and fast.transfer_bound_share == 0.0
    assert fp8_kv(spec).model.kv_dtype_bytes == 1 and fp8_kv(spec).kappa_crit_linear == pytest.approx(
        2 * spec.kappa_crit_linear)
