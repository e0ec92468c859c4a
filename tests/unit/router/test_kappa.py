"""κ model against REFERENCE.md §1 (B_kv exact, κ_crit within 5% of the paper's values)."""

from __future__ import annotations

import math

import pytest

from fleet_config.catalog import default_catalog
from router import kappa

CATALOG = default_catalog()

# REFERENCE.md §1, B_kv at bf16, bytes per token: reproduced exactly from model configs.
B_KV_REFERENCE = {
    "llama-3.1-8b": 131_072,
    "llama-3.1-70b": 327_680,
    "llama-3.1-405b": 516_096,
    "qwen3-0.6b": 114_688,
    "qwen3-8b": 147_456,
    "qwen3-235b-a22b": 192_512,
    "deepseek-v3": 70_272,
    "mistral-7b-v0.1": 131_072,
    "gpt-oss-20b": 49_152,
}


@pytest.mark.parametrize(("model", "expected"), B_KV_REFERENCE.items(), ids=list(B_KV_REFERENCE))
def test_b_kv_is_exact(model: str, expected: int) -> None:
    assert kappa.b_kv_bytes(CATALOG.model(model)) == expected


def test_gpt_oss_full_attention_b_kv() -> None:
    assert kappa.b_kv_full_attention_bytes(CATALOG.model("gpt-oss-20b")) == 24_576


# Paper values with κ_HW = 34e-6 (the paper's H100 hardware factor), linear F_pf = 2·N_active.
@pytest.mark.parametrize(
    ("model", "paper_kappa_crit"),
    [("llama-3.1-70b", 14.3), ("qwen3-235b-a22b", 7.8), ("deepseek-v3", 36.0)],
    ids=["llama-3.1-70b", "qwen3-235b-a22b", "deepseek-v3"],
)
def test_kappa_crit_matches_paper_within_5_percent(model: str, paper_kappa_crit: float) -> None:
    value = kappa.kappa_crit(CATALOG.model(model), 34e-6)
    assert value == pytest.approx(paper_kappa_crit, rel=0.05)


def test_deepseek_is_about_4_6x_qwen3_235b() -> None:
    ratio = kappa.kappa_crit(CATALOG.model("deepseek-v3"), 34e-6) / kappa.kappa_crit(CATALOG.model("qwen3-235b-a22b"), 34e-6)
    assert ratio == pytest.approx(4.6, rel=0.05)


@pytest.mark.parametrize(
    ("uncached_prompt_tokens", "expected"),
    [(128, 15.2), (512, 17.1), (1024, 20.5), (2048, 33.7)],
    ids=["T=128", "T=512", "T=1024", "T=2048"],
)
def test_attention_aware_kappa_crit_grows_with_t(uncached_prompt_tokens: int, expected: float) -> None:
    value = kappa.kappa_crit(CATALOG.model("llama-3.1-70b"), 34e-6, uncached_prompt_tokens=uncached_prompt_tokens)
    assert value == pytest.approx(expected, rel=0.01)


def test_never_transfer_bound_above_t_3700() -> None:
    model = CATALOG.model("llama-3.1-70b")
    assert math.isfinite(kappa.kappa_crit(model, 34e-6, uncached_prompt_tokens=3600))
    assert math.isinf(kappa.kappa_crit(model, 34e-6, uncached_prompt_tokens=3700))


def test_attention_kappa_crit_is_the_crossover_of_load_and_compute() -> None:
    """At K = κ_crit(T)·T the load time equals the compute time (the definition)."""
    model, kappa_hw_value, new = CATALOG.model("llama-3.1-70b"), 34e-6, 1024
    c_eff = 1e15
    link = kappa_hw_value * c_eff
    cached = kappa.kappa_crit(model, kappa_hw_value, uncached_prompt_tokens=new) * new
    t_load = kappa.kv_bytes(model, cached) / link
    t_compute = kappa.prefill_flops(model, cached, new) / c_eff
    assert t_load == pytest.approx(t_compute, rel=1e-9)


def test_kappa_hw_of_b200_profile_is_near_paper() -> None:
    hw = CATALOG.hw("b200")
    value = kappa.kappa_hw(hw.host_link_sustained_bytes_per_s, kappa.c_eff_flops_per_s(hw))
    assert value == pytest.approx(13.5e-6, rel=0.15)


def test_h100_profile_reproduces_paper_hardware_factor() -> None:
    hw = CATALOG.hw("h100-sxm")
    assert kappa.kappa_hw(hw.host_link_sustained_bytes_per_s, kappa.c_eff_flops_per_s(hw)) == pytest.approx(34e-6, rel=0.02)


def test_kappa_ratio_guards_zero_new_tokens() -> None:
    assert kappa.kappa_ratio(65_000, 32) == pytest.approx(2031.25)
    assert kappa.kappa_ratio(10, 0) == 10


def test_sliding_window_kv_bytes_cap_at_window() -> None:
    model = CATALOG.model("gpt-oss-20b")
    assert kappa.kv_bytes(model, 100) == 100 * 49_152
    assert kappa.kv_bytes(model, 10_000) == 10_000 * 24_576 + 128 * 24_576
    mistral = CATALOG.model("mistral-7b-v0.1")
    assert kappa.kv_bytes(mistral, 8192) == 4096 * 131_072


def test_kappa_hw_rejects_nonpositive() -> None:
    with pytest.raises(ValueError, match="positive"):
        kappa.kappa_hw(0, 1e15)


def test_memoised_model_constants_follow_the_profile_not_its_name() -> None:
    # The per-model constants are memoised by identity: a changed copy of a profile (same
    # name) must get its own figures, not the original's.
    llama = default_catalog().model("llama-3.1-70b")
    half = llama.model_copy(update={"num_layers": 40})
    assert kappa.b_kv_bytes(llama) == 327_680
    assert kappa.b_kv_bytes(half) == 163_840
    assert kappa.attention_flops_coefficient(half) == kappa.attention_flops_coefficient(llama) / 2
    assert kappa.b_kv_bytes(llama) == 327_680
