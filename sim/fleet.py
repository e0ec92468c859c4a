"""A simulated fleet: the backends of a fleet config, as engine and router figures.

The schema is the one every reader of a fleet file shares (`fleet_config.Settings`):
`fleet_from_settings` reads only what the simulator needs —

    gateway.scrape_interval_s           how stale the router's view of each engine is
    index.block_size_tokens, index.bytes_per_token     the gateway's index block
    kv_pool.capacity_gb                 a KV store the backends share (or none)
    interconnect, backends[].kv_role    P/D: the links KV crosses and who prefills for whom
    backends[]: every field the gateway reads, through `Settings.backend_spec` (the router's
                figures) and `mock_vllm.app_factory.engine_config` (the engine's), exactly as
                ``kappa-gateway mock-fleet`` builds its mocks (``url`` is ignored: nothing
                is sent anywhere)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from fleet_config import Settings
from mock_vllm.app_factory import engine_config
from mock_vllm.types import EngineConfig
from prefix_index import BYTES_PER_TOKEN_ESTIMATE, DEFAULT_BLOCK_SIZE_TOKENS, block_size_bytes
from router.cost import BackendSpec
from router.link_factors import MeasurementSettings
from router.links import NO_INTERCONNECT, Interconnect, Link
from router.profiles import GB, Catalog
from router.types import PdFleet


@dataclass(frozen=True, slots=True)
class SimBackend:
    """One backend of the fleet.

    Args:
        id: the config's backend id.
        model: the served model name clients ask for.
        spec: model, hardware and deployment figures (the router's and the engine's).
        engine: the engine's settings (host tier bytes, KV block override).
        labels: the config's labels (``role: compute-dense`` marks the high-κ reference).
        kv_role: its P/D role, ``prefill`` | ``decode`` | ``both`` (the config's ``kv_role``).
        truth: the engine's own spec and settings where they differ from what the router is
            configured with (`fleet_with_truth`: the hardware is not what its config says); None:
            the engine runs ``spec`` and ``engine``.
    """

    id: str
    model: str
    spec: BackendSpec
    engine: EngineConfig = field(default_factory=EngineConfig)
    labels: Mapping[str, str] = field(default_factory=dict)
    kv_role: str = "both"
    truth: tuple[BackendSpec, EngineConfig] | None = None

    @property
    def host_tier_bytes(self) -> float:
        return self.engine.host_tier_bytes

    @property
    def engine_spec(self) -> BackendSpec:
        """What the engine runs: the truth's spec, else the configured one."""
        return self.spec if self.truth is None else self.truth[0]

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's settings: the truth's, else the configured ones."""
        return self.engine if self.truth is None else self.truth[1]


@dataclass(frozen=True, slots=True)
class Fleet:
    """The backends plus the gateway settings the simulated router runs with.

    Args:
        backends: at least one, ids unique.
        scrape_interval_s: period of the metrics scrape, s (> 0).
        block_size_tokens: the index block in tokens (> 0).
        bytes_per_token: the starting bytes/token estimate (> 0; calibrated online as live).
        kv_pool_bytes: capacity of the KV pool the backends share, bytes (``None``: no pool).
        interconnect: the configured P/D links (what the router prices; `router.links`).
        delivered_links: (prefill id, decode id) → the link a pull really crosses, where it differs
            from the configured one (a link that lies about its bandwidth); the engines' truth.
        unusable_links: (prefill id, decode id) pairs the router must not split over (found broken).
        measurement: how measured figures move the router's specs (`router.link_factors`; the
            config's ``routing.measured_figures``). Enabled, each backend's fit is fed as the
            gateway feeds it (`sim.measure`); disabled, nothing is measured and the router prices
            the configured specs, as before measurement.
    """

    backends: tuple[SimBackend, ...]
    scrape_interval_s: float = 1.0
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    bytes_per_token: float = BYTES_PER_TOKEN_ESTIMATE
    kv_pool_bytes: float | None = None
    interconnect: Interconnect = NO_INTERCONNECT
    delivered_links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    unusable_links: frozenset[tuple[str, str]] = frozenset()
    measurement: MeasurementSettings = field(default_factory=MeasurementSettings)

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

    def pd_fleet(self) -> PdFleet | None:
        """What the router gets on a P/D fleet (`dispatch.Dispatcher.pd`): roles and usable links;
        ``None`` when every backend is ``both`` (an aggregated fleet, decided as ever)."""
        if all(b.kv_role == "both" for b in self.backends):
            return None
        return PdFleet({b.id: b.kv_role for b in self.backends}, self.interconnect, self.unusable_links)

    def delivered_link(self, prefill_id: str, decode_id: str) -> Link | None:
        """The link a pull from ``prefill_id`` to ``decode_id`` really crosses (``delivered_links``,
        else the configured one; ``None``: none)."""
        return self.delivered_links.get((prefill_id, decode_id)) or self.interconnect.link(prefill_id, decode_id)

    def served_models(self) -> list[str]:
        """Served model names, in backend order, without repeats."""
        return list(dict.fromkeys(b.model for b in self.backends))


def fleet_from_settings(settings: Settings, catalog: Catalog) -> Fleet:
    """Build a `Fleet` from a validated fleet config.

    Raises:
        router.errors.ProfileError: an unknown model or hardware (a config not checked
            against ``catalog``).
    """
    backends = tuple(SimBackend(entry.id, entry.model, settings.backend_spec(catalog, entry), engine_config(entry),
                                dict(entry.labels), entry.kv_role) for entry in settings.backends)
    pool = settings.kv_pool
    return Fleet(backends, scrape_interval_s=settings.gateway.scrape_interval_s,
                 block_size_tokens=settings.index.block_size_tokens, bytes_per_token=settings.index.bytes_per_token,
                 kv_pool_bytes=None if pool is None else pool.capacity_gb * GB,
                 interconnect=settings.interconnect_table(), measurement=settings.routing.measured_figures.settings())


def fleet_with_truth(configured: Fleet, truth: Fleet) -> Fleet:
    """``configured`` (what the router is told) whose engines run ``truth``'s backends of the same ids
    (``kappa-gateway sim --fleet-truth``): their specs and engine settings, and the P/D links as
    ``truth`` has them (`Fleet.delivered_links`). The router's view, its index settings and its
    measurement settings stay ``configured``'s.

    Raises:
        ValueError: the two fleets' backend ids differ, or a backend serves another model in ``truth``.
    """
    by_id = {b.id: b for b in truth.backends}
    if set(by_id) != {b.id for b in configured.backends}:
        raise ValueError(f"the truth fleet's backends {sorted(by_id)} are not the configured fleet's "
                         f"{sorted(b.id for b in configured.backends)}")
    backends = []
    for b in configured.backends:
        t = by_id[b.id]
        if t.spec.model != b.spec.model:
            raise ValueError(f"backend {b.id} serves {t.spec.model.name} in the truth fleet, {b.spec.model.name} "
                             "in the configured one")
        backends.append(replace(b, truth=(t.spec, t.engine)))
    delivered = dict(configured.delivered_links)
    for p in configured.backends:
        for d in configured.backends:
            link = truth.delivered_link(p.id, d.id)
            if link is not None and link != configured.interconnect.link(p.id, d.id):
                delivered[(p.id, d.id)] = link
    return replace(configured, backends=tuple(backends), delivered_links=delivered)


def high_kappa_threshold(backends: Sequence[SimBackend]) -> float:
    """κ_ratio above which a request counts as high-κ: the lowest κ_crit_linear of the compute-dense
    backends (``labels.role == compute-dense``; all backends if none is labelled), as the demo reports."""
    dense = [b for b in backends if b.labels.get("role") == "compute-dense"] or list(backends)
    return min(b.spec.kappa_crit_linear for b in dense)
