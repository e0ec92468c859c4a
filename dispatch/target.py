"""One backend as dispatch sees it: static figures, the last scrape of its metrics, its ledger.

The gateway's backend states (`gateway.backends.backend_state.BackendState`) and the simulator's backends
(`sim.simulator`) are both `Target`s, so the pipeline reads the same fields in both. What a
`Target` knows is what a gateway can know: its config, what vLLM's ``/metrics`` said at
the last scrape (`BackendMetrics`), and its own ledger — never an engine's live state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dispatch.ledger import Ledger
from dispatch.measured import MeasuredFigures
from router.capacity import kv_capacity_bytes
from router.cost import BackendSpec
from router.link_factors import MeasurementSettings

__all__ = ["BackendMetrics", "Target"]


@dataclass(frozen=True, slots=True)
class BackendMetrics:
    """One scrape of a backend's vLLM metrics (REFERENCE.md §2). ``None`` where not exported.

    Attributes:
        num_requests_waiting, num_requests_running: ``vllm:num_requests_waiting`` / ``_running``.
        kv_cache_usage_ratio: ``vllm:kv_cache_usage_perc`` (a 0..1 fraction despite its name).
        block_size_tokens, num_gpu_blocks: ``vllm:cache_config_info``'s labels.
        process_start_time_s: ``process_start_time_seconds`` (restart detection).
        prefix_cache_queries_tokens, prefix_cache_hits_tokens: ``vllm:prefix_cache_queries_total``
            / ``_hits_total`` (a counter that goes backwards means a restart).
        prompt_tokens_total, generation_tokens_total: ``vllm:prompt_tokens_total`` /
            ``vllm:generation_tokens_total``, tokens (restart detection, as above).
        requests_succeeded_total: ``vllm:request_success_total`` summed over ``finished_reason``.
        prefill_time_count, prefill_time_sum_s: ``vllm:request_prefill_time_seconds``'s ``_count``
            and ``_sum``: finished requests and their summed time from first scheduled to first
            token, engine seconds (the κ_crit fit's measurement, `router.kappa_fit`); count None
            when not exported.
        kv_loaded_tokens_total: ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``: prompt
            tokens the engine loaded (host tier, KV connectors), counted when scheduled; None when not
            exported (`dispatch.tier_check`).
        kv_transfer_count, kv_transfer_seconds_total, kv_transfer_bytes_total, kv_transfer_failures_total:
            the KV connector's transfers into this engine (P/D: a decode instance pulling prefilled KV;
            vLLM's NixlConnector, ``vllm:nixl_xfer_time_seconds``' ``_count`` and ``_sum``,
            ``vllm:nixl_bytes_transferred_sum``, ``vllm:nixl_num_failed_transfers_total``); the count
            None when not exported (no connector, or "No Data": `gateway.backends.pd_links`).
    """

    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage_ratio: float = 0.0
    block_size_tokens: int | None = None
    num_gpu_blocks: int | None = None
    process_start_time_s: float | None = None
    prefix_cache_queries_tokens: float = 0.0
    prefix_cache_hits_tokens: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    requests_succeeded_total: float = 0.0
    prefill_time_count: float | None = None
    prefill_time_sum_s: float = 0.0
    kv_loaded_tokens_total: float | None = None
    kv_transfer_count: float | None = None
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_bytes_total: float = 0.0
    kv_transfer_failures_total: float = 0.0


@dataclass(eq=False)
class Target:
    """A backend dispatch may route to.

    Args:
        id: the config's backend id.
        spec: model, hardware and deployment figures: the profile's at first; what routing
            prices it with, moved by measurement (`measure`, `dispatch.measured`).
        host_tier_bytes: its host-memory KV offload tier, bytes (0: none).
        num_gpu_blocks_override: the config's vLLM ``--num-gpu-blocks-override`` (KV capacity
            until a scrape reports the real one).
        metrics: the last scrape (replaced whole by the owner at each scrape, through `scraped`).
        ledger: the gateway's charges there.
        foreign_requests: requests the last scrape found there beyond the gateway's own ledger
            at that moment (``num_requests_running + num_requests_waiting − in flight``, ≥ 0):
            traffic that did not come through this gateway or its replicas (`scraped`).
        measurement: how measured figures move ``spec`` (`router.link_factors.MeasurementSettings`).

    Attributes:
        profile_spec: the configured spec (``spec`` as constructed).
        figures: its fit, the fit's feed and the routed spec (`dispatch.measured.MeasuredFigures`).
    """

    id: str
    spec: BackendSpec
    host_tier_bytes: float = 0.0
    num_gpu_blocks_override: int | None = None
    metrics: BackendMetrics = field(default_factory=BackendMetrics)
    ledger: Ledger = field(default_factory=Ledger)
    foreign_requests: int = 0
    measurement: MeasurementSettings = field(default_factory=MeasurementSettings, repr=False)
    profile_spec: BackendSpec = field(init=False, repr=False)
    figures: MeasuredFigures = field(init=False, repr=False)
    _kv_capacity: tuple[BackendMetrics, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.profile_spec = self.spec
        self.figures = MeasuredFigures(self.spec, self.measurement)

    def measure(self, metrics: BackendMetrics, now_s: float) -> bool:
        """Close the fit's interval at a scrape of ``metrics`` at ``now_s`` (`dispatch.measured`);
        ``spec`` follows the routed figures. Returns whether it changed."""
        changed = self.figures.scraped(metrics.prefill_time_count, metrics.prefill_time_sum_s, now_s,
                                       metrics.kv_loaded_tokens_total)
        if changed:
            self.spec = self.figures.spec
        return changed

    def restarted(self) -> None:
        """The backend restarted: its measured figures start again from the profile."""
        if self.figures.restarted():
            self.spec = self.figures.spec

    def scraped(self, metrics: BackendMetrics) -> None:
        """Take a new scrape: it replaces `metrics`, and sets `foreign_requests` from its counts
        against the ledger now. Compared at the scrape, not at each decision: a count a second
        old set against the ledger of now would count requests that ended since as still there
        (measured: it moved the simulator's TTFT p90 by up to 20%, BENCHMARKS.md issue 25)."""
        self.metrics = metrics
        seen = metrics.num_requests_running + metrics.num_requests_waiting
        self.foreign_requests = max(seen - self.ledger.total_in_flight, 0)

    @property
    def kv_capacity_bytes(self) -> float:
        """KV memory, bytes (`router.capacity.kv_capacity_bytes`: the scraped block count, else
        the override, else vLLM's sizing rule). Computed once per scrape: it is read per request."""
        m = self.metrics
        cached = self._kv_capacity
        if cached is not None and cached[0] is m:
            return cached[1]
        capacity = kv_capacity_bytes(self.spec, num_gpu_blocks=m.num_gpu_blocks, block_size_tokens=m.block_size_tokens,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override)
        self._kv_capacity = (m, capacity)
        return capacity
