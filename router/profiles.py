"""Model and hardware profiles: the figures the κ model and the cost model run on.

A `ModelProfile` holds what sets a model's KV footprint and prefill FLOPs (layers, heads,
head_dim, MLA dims, sliding-window layers, parameter counts); a `HardwareProfile` holds one
accelerator's datasheet figures plus the measured or assumed ones that datasheets lack
(prefill efficiency, *sustained* host-link bandwidth, idle power). Both are built from
mappings — the YAML catalogs in ``config/`` or a Hugging Face ``config.json`` — never
from paths: reading files is the caller's job (DESIGN.md §2).

Fields are in the catalog's human units (TFLOP/s, GiB, TB/s, GB/s, W, billions); the
properties ending in SI units (``_flops_per_s``, ``_bytes``, ``_bytes_per_s``) are what the
formulas use. The formulas themselves live in `router.kappa` and `router.cost`.

Sources: REFERENCE.md §1 (models) and §5 (hardware); each catalog entry names its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.errors import ProfileError

GIB = 1024**3
GB = 1e9
TERA = 1e12
BILLION = 1e9


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelProfile(_Frozen):
    """One model's architecture, as far as KV bytes and prefill FLOPs need it.

    Attention layers are ``num_layers``; of those, ``sliding_window_layers`` attend only
    to the last ``sliding_window_tokens`` tokens (Mistral-7B: all 32 with window 4096;
    gpt-oss-20b: 12 of 24 with window 128). MLA models (DeepSeek-V2/V3) set
    ``kv_lora_rank`` and ``qk_rope_head_dim``: their KV cache holds one latent vector of
    ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer; ``head_dim`` is then
    the query/key head dimension (qk_nope + qk_rope) and ``v_head_dim`` the value's.
    """

    name: str
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    kv_dtype_bytes: float = Field(default=2, gt=0)
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, ge=0)
    sliding_window_tokens: int | None = Field(default=None, gt=0)
    sliding_window_layers: int = Field(default=0, ge=0)
    hidden_size: int | None = Field(default=None, gt=0)
    vocab_size: int | None = Field(default=None, gt=0)
    active_params_billions: float = Field(gt=0)
    total_params_billions: float = Field(gt=0)
    weight_dtype_bytes: float = Field(default=2, gt=0)
    weight_gib: float | None = Field(default=None, gt=0)
    max_model_len_tokens: int = Field(default=131072, gt=0)
    hf_id: str | None = None
    source: str = ""

    @model_validator(mode="after")
    def _check(self) -> ModelProfile:
        if self.sliding_window_layers > self.num_layers:
            raise ValueError("sliding_window_layers exceeds num_layers")
        if self.sliding_window_layers and self.sliding_window_tokens is None:
            raise ValueError("sliding_window_layers needs sliding_window_tokens")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("MLA needs both kv_lora_rank and qk_rope_head_dim")
        if self.active_params_billions > self.total_params_billions * 1.0001:
            raise ValueError("active_params_billions exceeds total_params_billions")
        return self

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def full_attention_layers(self) -> int:
        return self.num_layers - self.sliding_window_layers

    @property
    def active_params(self) -> float:
        return self.active_params_billions * BILLION

    @property
    def total_params(self) -> float:
        return self.total_params_billions * BILLION

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights resident in HBM: ``weight_gib`` if given, else params × dtype."""
        if self.weight_gib is not None:
            return self.weight_gib * GIB
        return self.total_params * self.weight_dtype_bytes

    @property
    def active_weight_bytes(self) -> float:
        """Bytes of weights one decode step reads at batch 1 (active params × dtype)."""
        return self.weight_bytes * self.active_params / self.total_params


class HardwareProfile(_Frozen):
    """One accelerator (datasheet figures plus the sustained link and efficiency)."""

    name: str
    peak_bf16_tflops: float = Field(gt=0)
    peak_fp8_tflops: float | None = Field(default=None, gt=0)
    prefill_efficiency: float = Field(gt=0, le=1)
    hbm_gib: float = Field(gt=0)
    hbm_bandwidth_tb_s: float = Field(gt=0)
    host_link: str = ""
    host_link_peak_gb_s: float = Field(gt=0)
    host_link_sustained_gb_s: float = Field(gt=0)
    tdp_w: float = Field(gt=0)
    idle_power_w: float = Field(ge=0)
    power_cap_compute_exponent: float = Field(default=1 / 3, gt=0, le=1)
    host_memory_gib: float = Field(default=0, ge=0)
    source: str = ""

    @model_validator(mode="after")
    def _check(self) -> HardwareProfile:
        if self.host_link_sustained_gb_s > self.host_link_peak_gb_s:
            raise ValueError("host_link_sustained_gb_s exceeds host_link_peak_gb_s")
        if self.idle_power_w >= self.tdp_w:
            raise ValueError("idle_power_w must be below tdp_w")
        return self

    @property
    def peak_bf16_flops_per_s(self) -> float:
        return self.peak_bf16_tflops * TERA

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    @property
    def hbm_bandwidth_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_tb_s * TERA

    @property
    def host_link_sustained_bytes_per_s(self) -> float:
        return self.host_link_sustained_gb_s * GB

    def power_cap_compute_factor(self, power_cap_w: float | None) -> float:
        """Fraction of full-power compute left under a power cap, in (0, 1].

        factor = ((cap − idle) / (TDP − idle)) ** power_cap_compute_exponent, 1 without a
        cap or with cap ≥ TDP. Source: DVFS scaling, dynamic power ∝ f·V² with V ∝ f, so
        clock ∝ power^(1/3) (the exponent is a profile setting).

        Raises:
            ProfileError: the cap is at or below idle power.
        """
        if power_cap_w is None or power_cap_w >= self.tdp_w:
            return 1.0
        if power_cap_w <= self.idle_power_w:
            raise ProfileError(
                f"{self.name}: power cap {power_cap_w} W is at or below idle power {self.idle_power_w} W"
            )
        share = (power_cap_w - self.idle_power_w) / (self.tdp_w - self.idle_power_w)
        return share**self.power_cap_compute_exponent


class Catalog(_Frozen):
    """The model and hardware catalogs, keyed by short name (``llama-3.1-70b``, ``h100-sxm``)."""

    models: dict[str, ModelProfile]
    hardware: dict[str, HardwareProfile]

    @classmethod
    def from_mappings(cls, models_doc: Mapping[str, Any], hardware_doc: Mapping[str, Any]) -> Catalog:
        """Build both catalogs from the parsed ``config/models.yaml`` and ``config/hardware.yaml``.

        Args:
            models_doc: ``{"models": {name: {field: value}}}``.
            hardware_doc: ``{"hardware": {name: {...}}, "defaults": {...}?}`` (``defaults`` is
                the YAML anchor block that entries merge in; it is not itself an entry).

        Raises:
            ProfileError: an unknown or invalid field, naming its path
                (``hardware.h100-sxm.hbm_gib: Input should be greater than 0``).
        """
        models = {
            name: _build(ModelProfile, f"models.{name}", {"name": name, **dict(fields)})
            for name, fields in _section(models_doc, "models", allowed={"models"}).items()
        }
        hardware = {
            name: _build(HardwareProfile, f"hardware.{name}", {"name": name, **dict(fields)})
            for name, fields in _section(hardware_doc, "hardware", allowed={"hardware", "defaults"}).items()
        }
        return cls(models=models, hardware=hardware)

    def model(self, name: str) -> ModelProfile:
        """The model called ``name``; raises ProfileError listing the known names."""
        try:
            return self.models[name]
        except KeyError:
            raise ProfileError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}") from None

    def hw(self, name: str) -> HardwareProfile:
        """The hardware called ``name``; raises ProfileError listing the known names."""
        try:
            return self.hardware[name]
        except KeyError:
            raise ProfileError(f"unknown hardware {name!r}; known: {', '.join(sorted(self.hardware))}") from None


def _section(doc: Mapping[str, Any], key: str, *, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise ProfileError(f"catalog must be a mapping with a {key!r} key")
    unknown = set(doc) - allowed
    if unknown:
        raise ProfileError(f"{sorted(unknown)[0]}: unknown key (expected {sorted(allowed)})")
    section = doc.get(key)
    if not isinstance(section, Mapping) or not all(isinstance(v, Mapping) for v in section.values()):
        raise ProfileError(f"{key}: must map names to mappings of fields")
    return section


def _build(cls: type[_Frozen], path: str, fields: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ProfileError(f"{path}{'.' + where if where else ''}: {err['msg']}") from exc
