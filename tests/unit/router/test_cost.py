"""Cost model: regimes, tiers, overlap, power caps and energy, on catalog profiles."""

from __future__ import annotations

import pytest

from fleet_config.catalog import default_catalog
from router import kappa
from router.cost import BackendSpec, RequestShape, kv_pool_link_gb_s, predict
from router.kappa import Regime

CATALOG = default_catalog()
LLAMA_70B = CATALOG.model("llama-3.1-70b")


def spec(hw: str = "h100-sxm", **kw: object) -> BackendSpec:
    return BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw(hw), tensor_parallel=kw.pop("tensor_parallel", 4), **kw)


def test_backend_spec_derives_kappa_crit_from_the_kappa_model() -> None:
    backend = spec()
    assert backend.kappa_crit_linear == pytest.approx(kappa.kappa_crit(LLAMA_70B, backend.kappa_hw))
    assert backend.kappa_hw == pytest.approx(kappa.kappa_hw(4 * 15e9, 4 * 989e12 * 0.45))


def test_regime_flips_at_kappa_crit_of_the_request() -> None:
    backend, new = spec(), 512
    crit = kappa.kappa_crit(LLAMA_70B, backend.kappa_hw, uncached_prompt_tokens=new)
    below = predict(RequestShape(0, 0.99 * crit * new, new, 1), backend)
    above = predict(RequestShape(0, 1.01 * crit * new, new, 1), backend)
    assert (below.regime, above.regime) == (Regime.COMPUTE, Regime.TRANSFER)
    assert below.kappa_crit == pytest.approx(crit)


def test_hbm_resident_kv_is_not_loaded() -> None:
    backend = spec()
    in_hbm = predict(RequestShape(50_000, 0, 100, 1), backend)
    in_host = predict(RequestShape(0, 50_000, 100, 1), backend)
    assert in_hbm.t_load_s == 0 and in_hbm.regime is Regime.COMPUTE
    assert in_host.t_load_s == pytest.approx(50_000 * 327_680 / (4 * 15e9))
    assert in_host.regime is Regime.TRANSFER and in_host.ttft_s > in_hbm.ttft_s
    assert in_hbm.kappa_ratio == in_host.kappa_ratio == 500


@pytest.mark.parametrize(("overlap", "combine"), [(True, max), (False, lambda a, b: a + b)], ids=["overlap", "serial"])
def test_prefill_combines_load_and_compute(overlap: bool, combine) -> None:
    est = predict(RequestShape(0, 4_000, 400, 1), spec(overlap_host_load=overlap))
    assert est.prefill_s == pytest.approx(combine(est.t_compute_s, est.t_load_s))


def test_bandwidth_rich_backend_wins_transfer_bound_and_compute_dense_wins_compute_bound() -> None:
    gh200 = BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw("gh200"), tensor_parallel=4)
    b200 = BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw("b200"), tensor_parallel=4)
    high_kappa = RequestShape(0, 60_000, 200, 1)
    big_prefill = RequestShape(0, 0, 30_000, 1)
    assert predict(high_kappa, gh200).ttft_s < predict(high_kappa, b200).ttft_s
    assert predict(big_prefill, b200).ttft_s < predict(big_prefill, gh200).ttft_s


def test_power_cap_slows_compute_lowers_power_and_raises_kappa_crit() -> None:
    full, capped = spec(), spec(power_cap_w=400)
    shape = RequestShape(0, 0, 8_000, 1)
    assert predict(shape, capped).t_compute_s > predict(shape, full).t_compute_s
    assert capped.max_power_w == 4 * 400
    assert capped.kappa_crit_linear > full.kappa_crit_linear


def test_transfer_bound_prefill_draws_less_power() -> None:
    backend = spec()
    compute = predict(RequestShape(0, 0, 4_000, 1), backend)
    transfer = predict(RequestShape(0, 20_000, 200, 1), backend)
    assert transfer.regime is Regime.TRANSFER
    compute_w = compute.energy_j / compute.prefill_s
    transfer_w = transfer.energy_j / transfer.prefill_s
    assert compute_w == pytest.approx(backend.max_power_w)
    assert backend.idle_power_w < transfer_w < 0.5 * backend.max_power_w


def test_ttft_and_e2e_compose() -> None:
    est = predict(RequestShape(1_000, 0, 1_000, 101), spec(), queue_wait_s=0.25)
    assert est.ttft_s == pytest.approx(0.25 + est.prefill_s)
    assert est.e2e_s == pytest.approx(est.ttft_s + 100 * est.decode_step_s)
    assert est.kv_demand_bytes == pytest.approx((2_000 + 101) * 327_680)


def test_link_override_replaces_profile_bandwidth() -> None:
    assert spec(host_link_gb_s=55).link_bytes_per_s == 55e9


def test_tensor_parallel_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tensor_parallel"):
        spec(tensor_parallel=0)


def test_pool_tokens_load_at_the_pool_link_and_host_tokens_at_the_host_link() -> None:
    """H100×4: host link 4 × 15 GB/s; a pool link of 40 GB/s. Llama-3.1-70B B_kv = 327,680 B/token."""
    backend = spec(kv_pool_link_gb_s=40)
    est = predict(RequestShape(0, 2_000, 100, 1, cached_kv_pool_tokens=30_000), backend)
    assert est.t_load_s == pytest.approx(2_000 * 327_680 / 60e9 + 30_000 * 327_680 / 40e9)
    assert est.load_bytes == pytest.approx(32_000 * 327_680)
    assert est.kappa_ratio == 320  # κ_ratio counts every cached token, pool included
    assert est.regime is Regime.TRANSFER


def test_pool_tokens_on_a_backend_without_a_pool_link_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_pool_link_gb_s"):
        predict(RequestShape(0, 0, 100, 1, cached_kv_pool_tokens=1_000), spec())
    with pytest.raises(ValueError, match="kv_pool_link_gb_s must be > 0"):
        spec(kv_pool_link_gb_s=0)


@pytest.mark.parametrize(("hw", "tp", "host_link", "expected"), [
    ("b200", 2, None, 2 * 15.0),      # PCIe (15 GB/s sustained) is slower than the 25 GB/s network
    ("h100-sxm", 4, None, 4 * 15.0),
    ("gh200", 4, None, 4 * 25.0),     # NVLink-C2C (300 GB/s) is not: the network limits
    ("h100-sxm", 4, 200.0, 4 * 25.0),  # a measured 50 GB/s per GPU host link: the network limits
])
def test_pool_link_is_the_slower_of_network_and_host_link_per_gpu(hw: str, tp: int, host_link: float | None,
                                                                    expected: float) -> None:
    assert kv_pool_link_gb_s(CATALOG.hw(hw), tp, link_gb_s_per_gpu=25.0, host_link_gb_s=host_link) == expected


def test_kappa_crit_of_a_pool_load_is_at_the_pool_link_so_it_agrees_with_the_regime() -> None:
    """Found by a newcomer: on a GH200 (host link 1.2 TB/s, pool link 100 GB/s) a pool load was
    'transfer' while the reported κ_crit, at the host link, was larger than its K/T."""
    gh200 = BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw("gh200"), tensor_parallel=4, kv_pool_link_gb_s=100)
    for new in (27, 224, 2_000):
        est = predict(RequestShape(0, 0, new, 1, cached_kv_pool_tokens=7_090), gh200)
        assert est.kappa_crit == pytest.approx(kappa.kappa_crit(LLAMA_70B, kappa.kappa_hw(100e9, gh200.c_eff_flops_per_s), uncached_prompt_tokens=new))
        assert (est.regime is Regime.TRANSFER) == (7_090 / new > est.kappa_crit)


def test_decode_reads_the_active_weights_and_the_kv_of_the_mean_context() -> None:
    """Each decode step reads the active weights and the KV of the context at the middle of the
    generation: prompt + output/2 tokens. Llama-3.1-8B (8.03e9 params × 2 B) on one H100 SXM
    (3.35 TB/s), a 10,000-token prompt and 1,000 output tokens: context 10,500 tokens."""
    backend = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))
    est = predict(RequestShape(0, 0, 10_000, 1_000), backend)
    step = (8.03e9 * 2 + 10_500 * 131_072) / 3.35e12  # 5.205 ms
    assert est.decode_step_s == pytest.approx(step, rel=1e-9)
    assert est.decode_step_s == pytest.approx(5.2046e-3, rel=1e-4)
    assert est.e2e_s == pytest.approx(est.ttft_s + 999 * step, rel=1e-9)
    longer = predict(RequestShape(0, 0, 10_000, 3_000), backend)  # a longer answer reads more KV per step
    assert longer.decode_step_s == pytest.approx((8.03e9 * 2 + 11_500 * 131_072) / 3.35e12, rel=1e-9)


# --- one κ_crit per request, and the ratio it is compared with (issue 13, items 1–2) ---------------

SPLIT_MODELS = ("llama-3.1-70b", "deepseek-v3", "gpt-oss-20b", "mistral-7b-v0.1")  # dense, MLA, two sliding-window


@pytest.mark.parametrize("model", SPLIT_MODELS)
def test_regime_is_transfer_exactly_when_kappa_ratio_loaded_exceeds_kappa_crit(model: str) -> None:
    """What the headers show decides the regime: x-kappa-ratio-loaded > x-kappa-crit ⇔ transfer,
    for any split of K over HBM, host tier and pool, sliding-window models included."""
    import random

    rng = random.Random(13)
    backends = [BackendSpec(model=CATALOG.model(model), hardware=CATALOG.hw(hw), tensor_parallel=tp, kv_pool_link_gb_s=pool)
                for hw, tp, pool in (("b200", 2, 30.0), ("gh200", 4, 100.0), ("h100-sxm", 4, None))]
    seen = set()
    for _ in range(600):
        backend = rng.choice(backends)
        new = rng.choice((1, 7, 64, 300, 1_000, 3_000, 12_000))
        hbm, host = rng.choice((0, 0, 500, 20_000)), rng.choice((0, 0, 100, 3_000, 40_000))
        pool = rng.choice((0, 0, 2_000, 30_000)) if backend.kv_pool_link_bytes_per_s else 0
        est = predict(RequestShape(hbm, host, new, 1, cached_kv_pool_tokens=pool), backend)
        assert est.kappa_ratio == pytest.approx((hbm + host + pool) / new)
        assert est.kappa_ratio_loaded == pytest.approx((host + pool) / new)
        if est.kappa_ratio_loaded == pytest.approx(est.kappa_crit, rel=1e-9):
            continue  # on the line itself rounding decides
        assert (est.regime is Regime.TRANSFER) == (est.kappa_ratio_loaded > est.kappa_crit), (backend.hardware.name, hbm, host, pool, new)
        assert (est.regime is Regime.TRANSFER) == (est.t_load_s > est.t_compute_s)
        seen.add(est.regime)
    assert seen == {Regime.COMPUTE, Regime.TRANSFER}


def test_a_large_hbm_hit_raises_kappa_ratio_not_the_load_the_regime_compares() -> None:
    """The issue's example: x-kappa-ratio 17.26 above x-kappa-crit 6.5, yet compute. On a B200 x2
    most of the K sits in HBM (read in place); only the host-tier part must be loaded."""
    b200 = BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw("b200"), tensor_parallel=2)
    est = predict(RequestShape(16_000, 1_260, 1_000, 1), b200)
    assert est.kappa_ratio == pytest.approx(17.26) and est.kappa_ratio > est.kappa_crit
    assert est.kappa_ratio_loaded == pytest.approx(1.26) and est.kappa_ratio_loaded < est.kappa_crit
    assert est.regime is Regime.COMPUTE


def test_kappa_crit_counts_the_attention_over_hbm_resident_kv() -> None:
    """K in HBM is not loaded but is attended to: it adds compute, so the κ_ratio_loaded at which the
    load overtakes the prefill rises with K_hbm. κ_crit is that crossover, found here by bisection
    on the cost model's own t_load and t_compute."""
    b200 = BackendSpec(model=LLAMA_70B, hardware=CATALOG.hw("b200"), tensor_parallel=2)
    new = 1_000
    for hbm in (0, 8_000, 40_000):
        lo, hi = 0.0, 1_000.0
        for _ in range(60):
            mid = (lo + hi) / 2
            est = predict(RequestShape(hbm, mid * new, new, 1), b200)
            lo, hi = (lo, mid) if est.t_load_s > est.t_compute_s else (mid, hi)
        crit = predict(RequestShape(hbm, 0, new, 1), b200).kappa_crit
        assert crit == pytest.approx(lo, rel=1e-6)
        assert crit == pytest.approx(kappa.kappa_crit(LLAMA_70B, b200.kappa_hw, uncached_prompt_tokens=new,
                                                      cached_hbm_tokens=hbm))
    assert predict(RequestShape(40_000, 0, new, 1), b200).kappa_crit > 1.5 * predict(RequestShape(0, 0, new, 1), b200).kappa_crit
