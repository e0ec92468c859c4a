"""``kappa-gateway crit``: the κ_crit figures an operator computes before deploying.

Two kinds of row (names as in `router.kappa`'s glossary):

- `crit_rows`, model × hardware from the catalogs: B_kv, κ_M, κ_HW and ``kappa_crit_linear``
  (κ_M · κ_HW, linear F_pf, the paper's per-backend figure) as `router.kappa` defines them,
  with optional overrides of κ_HW or of its parts; with T, also ``kappa_crit``, the
  attention-aware κ_crit(T) of a request that has nothing in HBM (`router.kappa.kappa_crit`).
- `backend_crit_rows`, backends of a fleet config: the κ_crit the gateway computes for a
  request with T uncached tokens and K cached split HBM / host tier / KV pool on that backend,
  by the router's own `router.cost.predict` on the backend's spec as the gateway builds it
  (`fleet_config.Settings.backend_spec`): what ``x-kappa-crit`` and ``/v1/kappa/route`` show
  for such a request there. Its link is the one the load crosses: the host link, or the KV
  pool's for pool tokens — on a GH200 with a pool, ``never`` from the host tier at T = 1024
  and 45 from the pool are both right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from fleet_config import Settings
from fleet_config.settings import BackendEntry
from gateway.commands.crit_measured import as_measured
from router import kappa
from router.cost import BackendSpec, RequestShape, predict
from router.link_factors import FACTORS, LinkFactorEstimates, measured_spec
from router.profiles import GB, TERA, Catalog


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else value  # JSON null: never transfer-bound


@dataclass(frozen=True, slots=True)
class CritRow:
    """One model × hardware row; bandwidth in GB/s, compute in TFLOP/s, κ figures dimensionless.

    ``kappa_crit`` is the attention-aware κ_crit at ``uncached_prompt_tokens`` (None without T,
    ``math.inf`` where no K makes the request transfer-bound).
    """

    model: str
    hardware: str
    b_kv_bytes: float
    b_kv_full_attention_bytes: float
    kappa_m: float
    link_gb_s: float
    c_eff_tflops: float
    kappa_hw: float
    kappa_crit_linear: float
    uncached_prompt_tokens: int | None
    kappa_crit: float | None

    def as_dict(self) -> dict[str, float | str | int | None]:
        """JSON-ready: ``kappa_crit`` null where never transfer-bound; no T, no ``kappa_crit`` key."""
        out = asdict(self)
        if self.uncached_prompt_tokens is None:
            del out["uncached_prompt_tokens"], out["kappa_crit"]
        else:
            out["kappa_crit"] = _finite(self.kappa_crit)
        return out


@dataclass(frozen=True, slots=True)
class BackendCritRow:
    """One backend of a fleet config and one request shape on it (tokens; GB/s; TFLOP/s).

    ``kappa_ratio`` (K/T), ``kappa_ratio_loaded`` (K_loaded/T), ``kappa_crit`` (``math.inf``:
    never) and ``regime`` are `router.cost.CostEstimate`'s for this shape. ``source``: ``profile`` (the
    config's figures) or ``measured`` (the gateway's measured factors applied to them,
    `gateway.commands.crit_measured`; ``measured`` names the factors that had evidence).
    """

    backend: str
    model: str
    hardware: str
    tensor_parallel: int
    link_gb_s: float
    kv_pool_link_gb_s: float | None
    c_eff_tflops: float
    kappa_hw: float
    kappa_crit_linear: float
    uncached_prompt_tokens: int
    cached_hbm_tokens: int
    cached_host_tokens: int
    cached_kv_pool_tokens: int
    kappa_ratio: float
    kappa_ratio_loaded: float
    kappa_crit: float
    regime: str
    source: str = "profile"
    measured: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, float | str | int | None]:
        """JSON-ready: ``kappa_crit`` null where never transfer-bound."""
        return {**asdict(self), "kappa_crit": _finite(self.kappa_crit)}


def _expand(names: Sequence[str], known: Sequence[str]) -> list[str]:
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
        uncached_prompt_tokens: T for the attention-aware ``kappa_crit``; ``None``: none.

    Raises:
        router.errors.ProfileError: an unknown model or hardware name.
    """
    rows = []
    for model_name in _expand(models, list(catalog.models)):
        model = catalog.model(model_name)
        for hw_name in _expand(hardware, list(catalog.hardware)):
            hw = catalog.hw(hw_name)
            link = (link_gb_s * GB) if link_gb_s is not None else hw.host_link_sustained_bytes_per_s
            c_eff = (c_eff_tflops * TERA) if c_eff_tflops is not None else kappa.c_eff_flops_per_s(hw)
            kappa_hw = kappa_hw_override if kappa_hw_override is not None else kappa.kappa_hw(link, c_eff)
            rows.append(CritRow(
                model=model_name, hardware=hw_name, b_kv_bytes=kappa.b_kv_bytes(model),
                b_kv_full_attention_bytes=kappa.b_kv_full_attention_bytes(model), kappa_m=kappa.kappa_m(model),
                link_gb_s=link / GB, c_eff_tflops=c_eff / TERA, kappa_hw=kappa_hw,
                kappa_crit_linear=kappa.kappa_crit(model, kappa_hw), uncached_prompt_tokens=uncached_prompt_tokens,
                kappa_crit=None if uncached_prompt_tokens is None else kappa.kappa_crit(
                    model, kappa_hw, uncached_prompt_tokens=uncached_prompt_tokens),
            ))
    return rows


def backend_crit_rows(
    settings: Settings,
    catalog: Catalog,
    backends: Sequence[str],
    *,
    uncached_prompt_tokens: int,
    cached_hbm_tokens: int = 0,
    cached_host_tokens: int = 0,
    cached_kv_pool_tokens: int = 0,
    measured: Mapping[str, LinkFactorEstimates] | None = None,
) -> list[BackendCritRow]:
    """One row per requested backend id (``all`` or empty: every backend), for one request shape; with
    ``measured`` (backend id → its measured factors), a ``measured`` row after each backend that has some.

    Raises:
        KeyError: an id the config does not have.
        ValueError: pool tokens on a backend without a KV pool link (`router.cost.predict`).
    """
    by_id = {b.id: b for b in settings.backends}
    rows = []
    for backend_id in _expand(backends, list(by_id)):
        if backend_id not in by_id:
            raise KeyError(f"unknown backend {backend_id!r} (the config has {', '.join(by_id)})")
        entry = by_id[backend_id]
        profile = settings.backend_spec(catalog, entry)
        found = (measured or {}).get(backend_id)
        names = () if found is None else tuple(n for n, e in zip(FACTORS, found, strict=True) if e is not None)
        for spec, source in [(profile, "profile")] + ([(measured_spec(profile, as_measured(found)), "measured")]
                                                     if names and found is not None else []):
            rows.append(_row(backend_id, entry, spec, source, names, uncached_prompt_tokens, cached_hbm_tokens,
                             cached_host_tokens, cached_kv_pool_tokens))
    return rows


def _row(backend_id: str, entry: BackendEntry, spec: BackendSpec, source: str, names: tuple[str, ...],
         uncached_prompt_tokens: int, cached_hbm_tokens: int, cached_host_tokens: int,
         cached_kv_pool_tokens: int) -> BackendCritRow:
    est = predict(RequestShape(cached_hbm_tokens, cached_host_tokens, uncached_prompt_tokens, 1,
                               cached_kv_pool_tokens), spec)
    return BackendCritRow(
        backend=backend_id, model=entry.model, hardware=entry.hardware, tensor_parallel=entry.tensor_parallel,
        link_gb_s=spec.link_bytes_per_s / GB, kv_pool_link_gb_s=spec.kv_pool_link_bytes_per_s / GB or None,
        c_eff_tflops=spec.c_eff_flops_per_s / TERA, kappa_hw=spec.kappa_hw,
        kappa_crit_linear=spec.kappa_crit_linear, uncached_prompt_tokens=uncached_prompt_tokens,
        cached_hbm_tokens=cached_hbm_tokens, cached_host_tokens=cached_host_tokens,
        cached_kv_pool_tokens=cached_kv_pool_tokens, kappa_ratio=est.kappa_ratio,
        kappa_ratio_loaded=est.kappa_ratio_loaded, kappa_crit=est.kappa_crit, regime=est.regime.value,
        source=source, measured=names if source == "measured" else ())
