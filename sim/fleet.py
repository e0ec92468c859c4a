"""A simulated fleet: the backends of a gateway config, as engine and router figures.

The schema is the gateway's (`gateway.settings`, which owns parsing and validation; `sim`
may not import it). `fleet_from_config` takes the *validated* config as plain data —
``Settings.model_dump()`` — and reads only what the simulator needs:

    gateway.scrape_interval_s           how stale the router's view of each engine is
    index.block_size_tokens, index.bytes_per_token     the gateway's index block
    models: {served name: {profile}}    served name -> catalog model (optional)
    kv_pool: {capacity_gb, link_gb_s_per_gpu} or None  a KV store the backends share
    backends[]: id, model, hardware, tensor_parallel, power_cap_w, host_tier_gb,
                host_link_gb_s, pool_link_gb_s, overlap_host_load, num_gpu_blocks_override, labels
                (``url`` is ignored: nothing is sent anywhere)

Each backend becomes a `router.cost.BackendSpec` (the router's figures) and a
`mock_vllm.types.EngineConfig` (the engine's: host tier in bytes, KV block override), built
as ``kappa-gateway mock-fleet`` builds its mock servers (`mock_vllm.app_factory`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mock_vllm.types import EngineConfig
from prefix_index import block_size_bytes
from router.cost import BackendSpec, pool_link_gb_s
from router.profiles import GB, Catalog


@dataclass(frozen=True, slots=True)
class SimBackend:
    """One backend of the fleet.

    Args:
        id: the config's backend id.
        model: the served model name clients ask for.
        spec: model, hardware and deployment figures (the router's and the engine's).
        engine: the engine's settings (host tier bytes, KV block override).
        labels: the config's labels (``role: compute-dense`` marks the high-κ reference).
    """

    id: str
    model: str
    spec: BackendSpec
    engine: EngineConfig = field(default_factory=EngineConfig)
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def host_tier_bytes(self) -> float:
        return self.engine.host_tier_bytes


@dataclass(frozen=True, slots=True)
class Fleet:
    """The backends plus the gateway settings the simulated router runs with.

    Args:
        backends: at least one, ids unique.
        scrape_interval_s: period of the metrics scrape, s (> 0).
        block_size_tokens: the index block in tokens (> 0).
        bytes_per_token: the starting bytes/token estimate (> 0; calibrated online as live).
        pool_bytes: capacity of the KV pool the backends share, bytes (``None``: no pool).
    """

    backends: tuple[SimBackend, ...]
    scrape_interval_s: float = 1.0
    block_size_tokens: int = 64
    bytes_per_token: float = 4.0
    pool_bytes: float | None = None

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("a fleet needs at least one backend")
        ids = [b.id for b in self.backends]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate backend ids in {ids}")
        if self.scrape_interval_s <= 0:
            raise ValueError("scrape_interval_s must be > 0")

    @property
    def block_size_bytes(self) -> int:
        """The index block in bytes (`prefix_index.block_size_bytes`)."""
        return block_size_bytes(self.block_size_tokens, self.bytes_per_token)

    def served_models(self) -> list[str]:
        """Served model names, in backend order, without repeats."""
        return list(dict.fromkeys(b.model for b in self.backends))


def fleet_from_config(doc: Mapping[str, Any], catalog: Catalog) -> Fleet:
    """Build a `Fleet` from a validated gateway config given as data.

    Args:
        doc: ``gateway.settings.Settings.model_dump()`` (or the same shape): validated,
            every key present.
        catalog: the model and hardware profiles the config names.

    Raises:
        KeyError: a section or field is missing (the config was not validated).
        router.errors.ProfileError: an unknown model or hardware.
        ValueError: a backend's figures are invalid.
    """
    profiles = {name: entry["profile"] for name, entry in doc.get("models", {}).items()}
    pool = doc.get("kv_pool")
    backends = []
    for entry in doc["backends"]:
        hardware = catalog.hw(entry["hardware"])
        pool_link = None
        if pool is not None:
            pool_link = entry.get("pool_link_gb_s") or pool_link_gb_s(
                hardware, entry["tensor_parallel"], link_gb_s_per_gpu=pool["link_gb_s_per_gpu"],
                host_link_gb_s=entry["host_link_gb_s"])
        spec = BackendSpec(
            model=catalog.model(profiles.get(entry["model"], entry["model"])),
            hardware=hardware,
            power_cap_w=entry["power_cap_w"],
            tensor_parallel=entry["tensor_parallel"],
            host_link_gb_s=entry["host_link_gb_s"],
            overlap_host_load=entry["overlap_host_load"],
            pool_link_gb_s=pool_link,
        )
        engine = EngineConfig(host_tier_bytes=entry["host_tier_gb"] * GB,
                              num_gpu_blocks_override=entry["num_gpu_blocks_override"])
        backends.append(SimBackend(entry["id"], entry["model"], spec, engine, dict(entry.get("labels", {}))))
    return Fleet(tuple(backends), scrape_interval_s=doc["gateway"]["scrape_interval_s"],
                 block_size_tokens=doc["index"]["block_size_tokens"], bytes_per_token=doc["index"]["bytes_per_token"],
                 pool_bytes=None if pool is None else pool["capacity_gb"] * GB)


def high_kappa_threshold(backends: Sequence[SimBackend]) -> float:
    """κ_ratio above which a request counts as high-κ: the lowest κ_crit of the compute-dense
    backends (``labels.role == compute-dense``; all backends if none is labelled), as the demo reports."""
    dense = [b for b in backends if b.labels.get("role") == "compute-dense"] or list(backends)
    return min(b.spec.kappa_crit for b in dense)
