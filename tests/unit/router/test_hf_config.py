"""ModelProfile from real Hugging Face config.json contents (the fields that matter, verbatim)."""

from __future__ import annotations

import pytest

from router import kappa
from router.errors import ProfileError
from router.hf_config import model_profile_from_hf_config

# Field values as published in each model's config.json on the Hugging Face Hub.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
    "num_experts_per_tok": 8, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "num_hidden_layers": 94, "vocab_size": 151936, "tie_word_embeddings": False,
    "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "max_position_embeddings": 163840,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 24,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "vocab_size": 201088, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4"}, "max_position_embeddings": 131072,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "sliding_window": 4096, "vocab_size": 32000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("config", "b_kv", "total_b", "active_b"),
    [
        (LLAMA_31_8B, 131_072, 8.03, 8.03),
        (QWEN3_235B, 192_512, 235.1, 22.2),
        (DEEPSEEK_V3, 70_272, 671.0, 37.5),
        (MISTRAL_7B, 131_072, 7.24, 7.24),
        (GPT_OSS_20B, 49_152, 20.9, 4.3),
    ],
    ids=["llama-3.1-8b", "qwen3-235b-a22b", "deepseek-v3", "mistral-7b", "gpt-oss-20b"],
)
def test_profile_from_config(config: dict, b_kv: int, total_b: float, active_b: float) -> None:
    profile = model_profile_from_hf_config("m", config)
    assert kappa.b_kv_bytes(profile) == b_kv
    assert profile.total_params_billions == pytest.approx(total_b, rel=0.03)
    assert profile.active_params_billions == pytest.approx(active_b, rel=0.03)


def test_sliding_window_layers_from_layer_types_and_from_window() -> None:
    gpt_oss = model_profile_from_hf_config("gpt-oss", GPT_OSS_20B)
    assert (gpt_oss.sliding_window_layers, gpt_oss.sliding_window_tokens) == (12, 128)
    assert kappa.b_kv_full_attention_bytes(gpt_oss) == 24_576
    mistral = model_profile_from_hf_config("mistral", MISTRAL_7B)
    assert (mistral.sliding_window_layers, mistral.sliding_window_tokens) == (32, 4096)
    assert model_profile_from_hf_config("qwen", QWEN3_235B).sliding_window_layers == 0


def test_quantised_weights_and_kv_dtype_override() -> None:
    deepseek = model_profile_from_hf_config("ds", DEEPSEEK_V3)
    assert deepseek.weight_dtype_bytes == 1
    fp8_kv = model_profile_from_hf_config("llama", LLAMA_31_8B, kv_dtype_bytes=1)
    assert kappa.b_kv_bytes(fp8_kv) == 65_536


def test_card_figures_override_estimates() -> None:
    profile = model_profile_from_hf_config("gpt-oss", GPT_OSS_20B, active_params_billions=3.6)
    assert profile.active_params_billions == 3.6


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_hidden_layers": None}, "num_hidden_layers"), ({"hidden_size": "4096"}, "hidden_size"),
     ({"vocab_size": True}, "vocab_size")],
    ids=["missing", "string", "bool"],
)
def test_bad_config_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        model_profile_from_hf_config("bad", {**LLAMA_31_8B, **change})
