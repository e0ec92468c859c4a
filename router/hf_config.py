"""Build a `ModelProfile` from a Hugging Face ``config.json`` (parsed to a mapping).

Operators have real config files, not our catalog. This reads the fields that set the KV
footprint and the prefill FLOPs, for the architectures vLLM serves most: Llama, Mistral,
Qwen2/Qwen3 (dense and MoE), DeepSeek-V2/V3 (MLA, MoE), gpt-oss (MoE, alternating
sliding-window layers). Field names are those of ``transformers``' configuration classes
(``LlamaConfig``, ``Qwen3MoeConfig``, ``DeepseekV3Config``, ``GptOssConfig``).

Parameter counts are estimated from the shapes (embeddings, attention, MLP or experts,
norms; biases and small extras ignored, so estimates run ≲1% low on dense models) unless
the caller passes them. Checked against the model cards: Llama-3.1-8B 8.03B, Qwen3-235B-A22B
235B/22B, DeepSeek-V3 671B/37B (tests/unit/router/test_hf_config.py). gpt-oss counts its
unembedding as active (≈4.3B vs the card's 3.6B, which leaves embeddings out); pass
``active_params_billions`` to use the card's figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.errors import ProfileError
from router.profiles import BILLION, ModelProfile

# Bytes per weight by quantisation method, for weight_bytes when the config says how the
# checkpoint is stored. MXFP4: 4-bit elements plus one 8-bit scale per 32 (OCP MX spec),
# 4.25 bits, applied to the whole model (gpt-oss keeps attention in BF16: a slight undercount).
_QUANT_WEIGHT_BYTES = {"fp8": 1.0, "mxfp4": 4.25 / 8, "awq": 0.5, "gptq": 0.5, "compressed-tensors": 1.0}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


def model_profile_from_hf_config(
    name: str,
    config: Mapping[str, Any],
    *,
    kv_dtype_bytes: float | None = None,
    active_params_billions: float | None = None,
    total_params_billions: float | None = None,
) -> ModelProfile:
    """A `ModelProfile` from a parsed ``config.json``.

    Args:
        name: the short name to give the profile.
        config: the parsed ``config.json`` (a mapping; nested ``text_config`` is used when
            present, as in multimodal wrappers).
        kv_dtype_bytes: bytes per KV element; default from ``torch_dtype`` (2 for bf16/fp16),
            pass 1 for an FP8 KV cache (vLLM ``--kv-cache-dtype fp8``).
        active_params_billions, total_params_billions: override the shape-based estimates.

    Returns:
        A validated `ModelProfile`.

    Raises:
        ProfileError: a required field is missing or malformed (the message names it).
    """
    cfg = config.get("text_config", config)
    if not isinstance(cfg, Mapping):
        raise ProfileError(f"{name}: config.json must be a JSON object")
    layers = _int(cfg, "num_hidden_layers", name)
    hidden = _int(cfg, "hidden_size", name)
    n_q = _int(cfg, "num_attention_heads", name)
    n_kv = int(cfg.get("num_key_value_heads") or n_q)
    vocab = _int(cfg, "vocab_size", name)
    attention = _attention_fields(cfg, name, hidden, n_q, n_kv)
    is_mla = attention["kv_lora_rank"] is not None
    window, sw_layers = _sliding_window(cfg, layers)

    total, active = _estimate_params(cfg, layers, hidden, n_q, n_kv, attention["head_dim"], vocab, is_mla)
    dtype_bytes = _DTYPE_BYTES.get(str(cfg.get("torch_dtype", config.get("torch_dtype", "bfloat16"))), 2)
    quant = (config.get("quantization_config") or {}).get("quant_method")
    fields: dict[str, Any] = {
        "name": name,
        "hf_id": config.get("_name_or_path") or None,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": n_q,
        **attention,
        "sliding_window_tokens": window,
        "sliding_window_layers": sw_layers,
        "vocab_size": vocab,
        "kv_dtype_bytes": kv_dtype_bytes if kv_dtype_bytes is not None else dtype_bytes,
        "weight_dtype_bytes": _QUANT_WEIGHT_BYTES.get(quant, dtype_bytes) if isinstance(quant, str) else dtype_bytes,
        "active_params_billions": active_params_billions or active / BILLION,
        "total_params_billions": total_params_billions or total / BILLION,
        "max_model_len_tokens": int(cfg.get("max_position_embeddings") or 131072),
        "source": "Hugging Face config.json; parameter counts estimated from shapes",
    }
    try:
        return ModelProfile.model_validate(fields)
    except ValueError as exc:
        raise ProfileError(f"{name}: {exc}") from exc


def _attention_fields(cfg: Mapping[str, Any], name: str, hidden: int, n_q: int, n_kv: int) -> dict[str, Any]:
    """The profile's KV-head geometry: MLA when ``kv_lora_rank`` is set (DeepSeek: one latent
    "KV head"; query/key head = nope + rope dims, its own value head), else GQA/MHA heads.

    Raises:
        ProfileError: an MLA config without positive integer ``qk_nope_head_dim``,
            ``qk_rope_head_dim`` or ``v_head_dim``.
    """
    if cfg.get("kv_lora_rank") is None:
        return {"num_kv_heads": n_kv, "head_dim": int(cfg.get("head_dim") or hidden // n_q), "v_head_dim": None,
                "kv_lora_rank": None, "qk_rope_head_dim": None}
    qk_nope = _int(cfg, "qk_nope_head_dim", name)
    rope = _int(cfg, "qk_rope_head_dim", name)
    return {"num_kv_heads": 1, "head_dim": qk_nope + rope, "v_head_dim": _int(cfg, "v_head_dim", name),
            "kv_lora_rank": cfg.get("kv_lora_rank"), "qk_rope_head_dim": cfg.get("qk_rope_head_dim")}


def _int(cfg: Mapping[str, Any], key: str, name: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ProfileError(f"{name}: config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _sliding_window(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    """(window tokens, number of sliding-window layers) from ``layer_types`` or ``sliding_window``."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None, 0
    layer_types = cfg.get("layer_types")
    if layer_types:
        return int(window), sum(1 for t in layer_types if t == "sliding_attention")
    return int(window), layers


def _estimate_params(
    cfg: Mapping[str, Any], layers: int, hidden: int, n_q: int, n_kv: int, head_dim: int, vocab: int, is_mla: bool
) -> tuple[float, float]:
    """(total, active) parameters from the shapes; see the module docstring for what counts."""
    if is_mla:
        q_lora = cfg.get("q_lora_rank")
        kv_lora, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        q_proj = hidden * q_lora + q_lora * n_q * head_dim if q_lora else hidden * n_q * head_dim
        attn = q_proj + hidden * (kv_lora + rope) + kv_lora * n_q * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        attn += n_q * cfg["v_head_dim"] * hidden
    else:
        attn = 2 * hidden * n_q * head_dim + 2 * hidden * n_kv * head_dim
    n_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 0)
    if n_experts:
        expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1)
        shared = int(cfg.get("n_shared_experts") or 0) * expert
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = layers - dense_layers
        router = hidden * n_experts
        mlp_total = dense_layers * dense_mlp + moe_layers * (n_experts * expert + shared + router)
        mlp_active = dense_layers * dense_mlp + moe_layers * (top_k * expert + shared + router)
    else:
        mlp_total = mlp_active = layers * dense_mlp
    tied = bool(cfg.get("tie_word_embeddings", False))
    embeddings = vocab * hidden * (1 if tied else 2)
    common = layers * (attn + 2 * hidden) + embeddings + hidden
    return common + mlp_total, common + mlp_active
