"""The κ model: the single definition of B_kv, F_pf, κ_M, κ_HW, κ_crit and κ_ratio.

Source: Meng, Lee & Wang, "Prefill is not always compute-bound" (arXiv 2601.19910), as
summarised in DESIGN.md §3; reference values in REFERENCE.md §1.

A request finds K prompt tokens already cached and must prefill T new ones. Loading the
cached KV moves ``K · B_kv`` bytes over the link from wherever it lives; prefilling costs
``T · F_pf`` FLOPs. With a link of ``BW_link`` bytes/s and ``C_eff`` FLOP/s:

    t_load    = K · B_kv / BW_link            t_compute = T · F_pf / C_eff

    transfer-bound  ⇔  t_load > t_compute  ⇔  K / T > (F_pf / B_kv) · (BW_link / C_eff)

    κ_ratio = K / T                       (dimensionless; the request's property)
    κ_M     = F_pf / B_kv                 (FLOP/byte; the model's property)
    κ_HW    = BW_link / C_eff             (byte/FLOP; the backend's property)
    κ_crit  = κ_M · κ_HW                  (dimensionless; the crossover)

Terms:
    B_kv    KV bytes per token: 2 · L · n_kv_heads · head_dim · dtype_bytes (K and V for each
            attention layer); MLA (DeepSeek-V2/V3): L · (kv_lora_rank + qk_rope_head_dim) ·
            dtype_bytes, one latent per token and layer. This is the nominal figure over all
            attention layers, the paper's Table 3 convention; `kv_bytes` gives the footprint
            of n tokens with sliding-window layers capped at their window.
    F_pf    prefill FLOPs per new token. Linear part 2 · N_active (one multiply-add per
            active weight); attention adds a · (K + T/2) per new token, where
            a = 2 · L_full · n_q_heads · (d_qk + d_v) (= 4 · L · n_q · head_dim when
            d_qk = d_v): QKᵀ and AV over the K cached plus, on average, T/2 earlier new tokens.
            Sliding-window layers attend to at most their window.
    BW_link the *sustained* bandwidth from the tier the cached KV sits in, not the datasheet
            peak (the paper measured ~15 GB/s on a 64 GB/s PCIe 5 link).
    C_eff   peak dense FLOP/s × prefill efficiency × power-cap factor × tensor-parallel size.

With the attention term, κ_crit depends on T. Solving t_load = t_compute for x = K/T with
c = κ_HW / B_kv and linear F_lin:

    κ_crit(T) = c · (F_lin + a·T/2) / (1 − c·a·T),   and ∞ when c·a·T ≥ 1

(Llama-3.1-70B at κ_HW = 34e-6: 15.2 at T=128, 33.7 at T=2048, never transfer-bound above
T ≈ 3,700 — REFERENCE.md §1.)

KV already resident in HBM is read in place, not loaded, but it is attended to: it adds
a·K_hbm FLOPs per new token and no bytes to move. So a request's own threshold also depends
on K_hbm, and on the link its loads cross (host tier or fleet-shared KV pool):

    κ_crit(T, K_hbm) = c · (F_lin + a·(K_hbm + T/2)) / (1 − c·a·T),   c = κ_HW(link) / B_kv

and the regime compares the part that must move, κ_ratio_loaded = K_loaded / T (host tier +
pool), with it, while the reported κ_ratio counts every cached token (the paper's figure).

The κ figures, one name each (README "κ figures"; every surface — response headers,
``/v1/kappa/*`` JSON, metrics, the ``crit`` CLI, the demo report, the dashboard — uses these):

    kappa_ratio          K / T, K = every cached prompt token (HBM + host tier + KV pool)
    kappa_ratio_loaded   K_loaded / T, K_loaded = host tier + KV pool: the KV that must move
    kappa_crit           a request's threshold on one backend: `kappa_crit` at its T and
                         K_hbm, at the link its loads cross (`router.cost.predict`); the
                         request is transfer-bound there iff kappa_ratio_loaded > kappa_crit
    kappa_crit_linear    a backend's T-independent figure κ_M · κ_HW(host link) with linear
                         F_pf: the paper's κ_crit, the limit of kappa_crit as T, K_hbm → 0
"""

from __future__ import annotations

import math
from enum import StrEnum

from router.profiles import HardwareProfile, ModelProfile


class Regime(StrEnum):
    """Which resource bounds a request's prefill on a backend."""

    COMPUTE = "compute"
    TRANSFER = "transfer"


def b_kv_bytes(model: ModelProfile) -> float:
    """B_kv: KV-cache bytes per token over all attention layers (nominal), bytes/token.

    Llama-3.1-70B: 2·80·8·128·2 = 327,680; DeepSeek-V3 (MLA): 61·(512+64)·2 = 70,272.
    """
    return model_constants(model).b_kv


def b_kv_full_attention_bytes(model: ModelProfile) -> float:
    """KV bytes per token of the full-attention layers only (what grows without bound), bytes/token.

    gpt-oss-20b: 12 of 24 layers → 24,576 (nominal B_kv 49,152). Equal to `b_kv_bytes` for
    models without sliding-window layers.
    """
    return model_constants(model).b_kv_full


def _b_kv_of(model: ModelProfile) -> float:
    if model.kv_lora_rank is not None and model.qk_rope_head_dim is not None:  # MLA (both set, or neither)
        return model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * model.kv_dtype_bytes
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.kv_dtype_bytes


class ModelConstants:
    """The per-model figures the formulas here start from, derived once per profile (the
    router evaluates them for every candidate of every request). Read-only by convention.

    Attributes:
        b_kv, b_kv_full: `b_kv_bytes`, `b_kv_full_attention_bytes` (bytes/token).
        f_linear: `linear_prefill_flops_per_token` (FLOP/token).
        a_full, a_sliding: `attention_flops_coefficient` of the full-attention and the
            sliding-window layers (FLOP per new × attended token).
        window_tokens: the sliding window (tokens), 0 without sliding-window layers.
        weight_bytes, active_weight_bytes: the profile's (bytes).
        active_share: active / total parameters (1 for dense models).
    """

    __slots__ = ("b_kv", "b_kv_full", "f_linear", "a_full", "a_sliding", "window_tokens", "weight_bytes",
                 "active_weight_bytes", "active_share")

    def __init__(self, model: ModelProfile) -> None:
        self.b_kv = _b_kv_of(model)
        self.b_kv_full = self.b_kv * model.full_attention_layers / model.num_layers
        self.f_linear = 2.0 * model.active_params
        d_v = model.v_head_dim or model.head_dim
        per_layer = 2.0 * model.num_attention_heads * (model.head_dim + d_v)
        self.a_full = model.full_attention_layers * per_layer
        self.a_sliding = model.sliding_window_layers * per_layer
        self.window_tokens = model.sliding_window_tokens if model.sliding_window_layers else 0
        self.weight_bytes = model.weight_bytes
        self.active_weight_bytes = model.active_weight_bytes
        self.active_share = model.active_params / model.total_params

    def kv_bytes(self, tokens: float) -> float:
        """`kv_bytes` of ``tokens`` tokens (bytes)."""
        if not self.window_tokens:
            return tokens * self.b_kv_full
        return tokens * self.b_kv_full + min(tokens, self.window_tokens) * (self.b_kv - self.b_kv_full)

    def weights_read_bytes(self, batch_tokens: float) -> float:
        """Weight bytes one forward pass over ``batch_tokens`` tokens reads from HBM.

        Dense models read every weight. An MoE layer reads the experts the batch routes to:
        with a share s = active/total of the parameters used per token, the expected share
        touched by n tokens is 1 − (1 − s)^n (tokens routed independently).
        """
        return self.weight_bytes * (1.0 - (1.0 - self.active_share) ** max(batch_tokens, 1.0))

    def prefill_flops(self, cached_tokens: float, uncached_prompt_tokens: float) -> float:
        """`prefill_flops` (FLOP)."""
        t, span = uncached_prompt_tokens, cached_tokens + uncached_prompt_tokens / 2.0
        flops = t * self.f_linear + self.a_full * t * span
        if self.window_tokens:
            flops += self.a_sliding * t * min(span, self.window_tokens)
        return flops

    def kappa_crit(self, kappa_hw_bytes_per_flop: float, uncached_prompt_tokens: float, *,
                   cached_hbm_tokens: float = 0.0, loaded_tokens: float = 0.0,
                   bytes_per_loaded_token: float | None = None) -> float:
        """`kappa_crit` at T = ``uncached_prompt_tokens`` after ``cached_hbm_tokens`` read in place.

        The κ_ratio_loaded = K_loaded / T at which loading K_loaded tokens over the link of
        ``kappa_hw_bytes_per_flop`` takes as long as the prefill. Models without sliding-window
        layers: the closed form of the module docstring with B_kv = ``bytes_per_loaded_token``
        (default: `kv_bytes` per token of ``loaded_tokens``, B_kv when nothing is loaded).
        Sliding-window layers make load and compute bend at the window; there it is the
        crossover of the lines tangent to both at the request's own K_loaded (``loaded_tokens``),
        so that ``K_loaded / T > kappa_crit`` holds exactly when its load outlasts its compute.
        """
        t = uncached_prompt_tokens
        if bytes_per_loaded_token is None:
            bytes_per_loaded_token = self.kv_bytes(loaded_tokens) / loaded_tokens if loaded_tokens > 0 else self.b_kv
        c = kappa_hw_bytes_per_flop / bytes_per_loaded_token
        slope = self.a_full  # attention FLOPs per new token that one more loaded token adds
        flops = self.f_linear + self.a_full * (cached_hbm_tokens + t / 2.0)  # per new token, at K_loaded = 0
        if self.window_tokens:
            if cached_hbm_tokens + loaded_tokens + t / 2.0 < self.window_tokens:
                slope += self.a_sliding
                flops += self.a_sliding * (cached_hbm_tokens + t / 2.0)
            else:
                flops += self.a_sliding * self.window_tokens
        denominator = 1.0 - c * slope * t
        if denominator <= 0:
            return math.inf
        return c * flops / denominator


_CONSTANTS: dict[int, tuple[ModelProfile, ModelConstants]] = {}
_CONSTANTS_MAX = 1024  # profiles are few and live as long as the process; tests build many


def model_constants(model: ModelProfile) -> ModelConstants:
    """The profile's `ModelConstants`, memoised by identity (profiles are frozen; hashing a
    pydantic model would cost more than the formulas)."""
    hit = _CONSTANTS.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_CONSTANTS) >= _CONSTANTS_MAX:
        _CONSTANTS.clear()
    constants = ModelConstants(model)
    _CONSTANTS[id(model)] = (model, constants)
    return constants


def kv_bytes(model: ModelProfile, tokens: float) -> float:
    """KV-cache bytes that ``tokens`` tokens of one sequence occupy, sliding windows capped.

    = tokens · B_kv_full + min(tokens, window) · (B_kv − B_kv_full). Used for memory
    accounting (admission) and for the bytes a load moves.
    """
    return model_constants(model).kv_bytes(tokens)


def linear_prefill_flops_per_token(model: ModelProfile) -> float:
    """F_pf without attention: 2 · N_active FLOPs per new token."""
    return model_constants(model).f_linear


def attention_flops_coefficient(model: ModelProfile, *, full_attention_only: bool = True) -> float:
    """a: attention FLOPs per (new token × attended token), summed over layers.

    a = 2 · L · n_q · (d_qk + d_v), over the full-attention layers (``full_attention_only``)
    or the sliding-window layers (``False`` gives the sliding-window layers' coefficient).
    """
    c = model_constants(model)
    return c.a_full if full_attention_only else c.a_sliding


def prefill_flops(model: ModelProfile, cached_tokens: float, uncached_prompt_tokens: float) -> float:
    """Total FLOPs to prefill ``uncached_prompt_tokens`` after ``cached_tokens`` cached ones.

    = T · 2·N_active + a_full · T · (K + T/2) + a_sw · T · min(K + T/2, window).
    """
    return model_constants(model).prefill_flops(cached_tokens, uncached_prompt_tokens)


def c_eff_flops_per_s(hw: HardwareProfile, *, power_cap_w: float | None = None, tensor_parallel: int = 1) -> float:
    """C_eff: sustained prefill FLOP/s = peak BF16 dense × prefill efficiency × cap factor × TP."""
    factor = hw.power_cap_compute_factor(power_cap_w)
    return hw.peak_bf16_flops_per_s * hw.prefill_efficiency * factor * tensor_parallel


def kappa_m(model: ModelProfile) -> float:
    """κ_M = F_pf / B_kv with linear F_pf, FLOP/byte (Llama-3.1-70B: 430,603)."""
    return linear_prefill_flops_per_token(model) / b_kv_bytes(model)


def kappa_hw(link_bytes_per_s: float, c_eff: float) -> float:
    """κ_HW = BW_link / C_eff, byte/FLOP (H100 at 15 GB/s, C_eff 445 TFLOP/s: 33.7e-6)."""
    if link_bytes_per_s <= 0 or c_eff <= 0:
        raise ValueError("link bandwidth and C_eff must be positive")
    return link_bytes_per_s / c_eff


def kappa_crit(model: ModelProfile, kappa_hw_bytes_per_flop: float, *, uncached_prompt_tokens: float | None = None,
               cached_hbm_tokens: float = 0.0) -> float:
    """κ_crit, the κ_ratio_loaded above which loading the cached KV takes longer than the prefill.

    Args:
        model: the model profile.
        kappa_hw_bytes_per_flop: κ_HW of the backend at the link the load crosses (`kappa_hw`), byte/FLOP.
        uncached_prompt_tokens: T; ``None`` gives ``kappa_crit_linear`` = κ_M · κ_HW (linear
            F_pf, the paper's figure), a number gives the attention-aware κ_crit(T, K_hbm) of
            the module docstring (`ModelConstants.kappa_crit`).
        cached_hbm_tokens: K_hbm, cached tokens read in place (attended to, not loaded); only
            with ``uncached_prompt_tokens``.

    Returns:
        κ_crit (dimensionless), ``math.inf`` when no K makes the request transfer-bound.

    Raises:
        ValueError: ``cached_hbm_tokens`` without ``uncached_prompt_tokens``.
    """
    if uncached_prompt_tokens is None:
        if cached_hbm_tokens:
            raise ValueError("cached_hbm_tokens needs uncached_prompt_tokens (the linear κ_crit has neither)")
        return kappa_m(model) * kappa_hw_bytes_per_flop
    return model_constants(model).kappa_crit(kappa_hw_bytes_per_flop, uncached_prompt_tokens,
                                             cached_hbm_tokens=cached_hbm_tokens)


def kappa_ratio(cached_tokens: float, uncached_prompt_tokens: float) -> float:
    """κ_ratio = K / max(T, 1): cached over new prompt tokens (vLLM computes at least one).

    With K = every cached token it is ``kappa_ratio``; with K = the loaded ones (host tier +
    KV pool) it is ``kappa_ratio_loaded``, the figure the regime compares with κ_crit.
    """
    return cached_tokens / max(uncached_prompt_tokens, 1.0)
