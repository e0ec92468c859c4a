"""``kappa-gateway crit``: the κ_crit table an operator computes before deploying.

For each model × hardware pair: B_kv, κ_M, κ_HW and κ_crit as `router.kappa` defines
them, with optional overrides of κ_HW or of its parts (sustained link bandwidth, C_eff).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from router import kappa
from router.profiles import GB, TERA, Catalog


@dataclass(frozen=True, slots=True)
class CritRow:
    """One model × hardware row; bandwidth in GB/s, compute in TFLOP/s, κ_crit dimensionless."""

    model: str
    hardware: str
    b_kv_bytes: float
    b_kv_full_attention_bytes: float
    kappa_m: float
    link_gb_s: float
    c_eff_tflops: float
    kappa_hw: float
    kappa_crit: float
    uncached_prompt_tokens: int | None

    def as_dict(self) -> dict[str, float | str | int | None]:
        return asdict(self)


def _expand(names: Sequence[str], known: dict) -> list[str]:
    if not names or "all" in names:
        return list(known)
    return list(names)


def crit_rows(
    catalog: Catalog,
    models: Sequence[str],
    hardware: Sequence[str],
    *,
    kappa_hw_override: float | None = None,
    link_gb_s: float | None = None,
    c_eff_tflops: float | None = None,
    uncached_prompt_tokens: int | None = None,
) -> list[CritRow]:
    """Rows for every requested model × hardware pair (``all`` or empty means every entry).

    Args:
        catalog: the model and hardware catalogs.
        models, hardware: catalog names.
        kappa_hw_override: use this κ_HW (byte/FLOP) for every pair, e.g. the paper's 34e-6.
        link_gb_s: sustained host-link bandwidth, GB/s (gigabytes), instead of the profile's.
        c_eff_tflops: effective prefill compute, TFLOP/s, instead of peak × efficiency.
        uncached_prompt_tokens: T for the attention-aware κ_crit(T); ``None`` gives the linear κ_crit.

    Raises:
        router.errors.ProfileError: an unknown model or hardware name.
    """
    rows = []
    for model_name in _expand(models, catalog.models):
        model = catalog.model(model_name)
        for hw_name in _expand(hardware, catalog.hardware):
            hw = catalog.hw(hw_name)
            link = (link_gb_s * GB) if link_gb_s is not None else hw.host_link_sustained_bytes_per_s
            c_eff = (c_eff_tflops * TERA) if c_eff_tflops is not None else kappa.c_eff_flops_per_s(hw)
            kappa_hw = kappa_hw_override if kappa_hw_override is not None else kappa.kappa_hw(link, c_eff)
            rows.append(
                CritRow(
                    model=model_name,
                    hardware=hw_name,
                    b_kv_bytes=kappa.b_kv_bytes(model),
                    b_kv_full_attention_bytes=kappa.b_kv_full_attention_bytes(model),
                    kappa_m=kappa.kappa_m(model),
                    link_gb_s=link / GB,
                    c_eff_tflops=c_eff / TERA,
                    kappa_hw=kappa_hw,
                    kappa_crit=kappa.kappa_crit(model, kappa_hw, uncached_prompt_tokens=uncached_prompt_tokens),
                    uncached_prompt_tokens=uncached_prompt_tokens,
                )
            )
    return rows
