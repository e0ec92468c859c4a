"""Prometheus metrics of the gateway, on an injected registry (never the global one).

Label values come only from the config (backend ids, served model names, policy names) and
from closed sets (regime, status class, index operation): never from raw request values, so
a client cannot blow up cardinality. Names follow Prometheus conventions: base units,
``_total`` on counters, ratios in [0, 1]. The κ names are `router.kappa`'s: ``kappa_ratio``
= K/T over every cached token, ``kappa_ratio_loaded`` = K_loaded/T (host tier + KV pool),
``kappa_crit_linear`` = the backend's T-independent κ_M·κ_HW. A request's own κ_crit (at its T)
is in its ``x-kappa-crit`` header, not a metric; its regime labels ``gateway_requests_total``.
Every labelled series a request can touch is created
at start-up at 0 (`Telemetry.init_backend`, `Telemetry.init_requests`): ``rate()`` needs a
series to exist before its first increment, or the first requests never show.
Multiprocess mode (``serve --workers``) is chosen by `Telemetry`'s ``multiprocess_dir``, which the
app factory reads from ``PROMETHEUS_MULTIPROC_DIR``; nothing here reads the environment.

| metric | type | labels |
| --- | --- | --- |
| ``gateway_requests_total`` | counter | backend, model, policy, regime, status |
| ``gateway_routing_decision_seconds`` | histogram | policy |
| ``gateway_kappa_ratio`` | histogram (log buckets 0.01…1e5) | backend |
| ``gateway_kappa_ratio_loaded`` | histogram (the same buckets) | backend |
| ``gateway_kappa_crit_linear`` | gauge | backend, kind=predicted\\|measured (measured: `router.kappa_fit`) |
| ``gateway_kappa_crit_linear_measured_interval`` | gauge | backend, bound=low\\|high (the measured κ_crit_linear's 95% interval) |
| ``gateway_kappa_fit_requests`` | gauge | backend, kind=compute\\|load (requests behind the measured κ_crit_linear) |
| ``gateway_backend_profile_deviation_ratio`` | gauge | backend, factor=compute\\|host_link\\|kv_pool_link\\|hbm (measured over profiled seconds, `router.link_factors`) |
| ``gateway_prompt_tokens_total`` | counter | backend, source=cached_hbm\\|cached_host\\|cached_kv_pool\\|uncached (index estimate) |
| ``gateway_cached_tokens_estimated_total`` / ``gateway_cached_tokens_reported_total`` | counter | backend |
| ``gateway_prefix_invalidated_tokens_total`` / ``gateway_prefix_invalidations_total`` | counter | model, cause = front_truncation\\|compaction\\|edit\\|reorder (`prefix_index.invalidation`) |
| ``gateway_ttft_seconds``, ``gateway_itl_seconds``, ``gateway_e2e_seconds`` | histogram | backend (TTFT, ITL: streams only) |
| ``gateway_time_to_response_headers_seconds`` | histogram | backend, stream=true\\|false |
| ``gateway_in_flight_requests``, ``gateway_kv_demand_bytes`` | gauge | backend |
| ``gateway_backend_up`` | gauge | backend |
| ``gateway_upstream_retries_total`` | counter | backend (the one that failed) |
| ``gateway_upstream_failures_total`` | counter | backend, kind = connect-failure\\|reset\\|5xx\\|timeout\\|idle-timeout\\|mid-stream |
| ``gateway_outlier_ejections_total`` | counter | backend |
| ``gateway_outlier_ejections_overflow_total`` | counter | backend (an outlier left in: ``max_ejection_percent`` reached) |
| ``gateway_panic_mode`` / ``gateway_panic_mode_entries_total`` | gauge / counter | model (1 while routing to all its backends) |
| ``gateway_index_errors_total`` | counter | op |
| ``gateway_index_predictions_total`` | counter | backend, outcome = within_one_block\\|over\\|under (predicted K vs reported cached_tokens) |
| ``gateway_index_resets_total`` | counter | backend (a backend id, or ``@kv-pool``), reason = restart\\|cached-tokens-shortfall\\|kv-pool-backends-restarted |
| ``gateway_index_skipped_total`` | counter | op (match\\|record\\|forget): not sent, the index's circuit breaker was open |
| ``gateway_index_degraded`` | gauge | — (1 while the Redis index's circuit breaker is open or half-open, else 0) |
| ``gateway_index_seconds`` | histogram | op |
| ``gateway_bytes_per_token`` | gauge | model (calibrated from backends' usage) |
| ``gateway_peer_replicas`` | gauge | (replicas seen at the last load exchange, `gateway.replicas.peer_load`) |
| ``gateway_peer_sync_errors_total`` | counter | |
| ``gateway_admin_unauthorized_total`` | counter | (admin routes refused for a missing or wrong key) |
| ``gateway_load_only_requests_total`` | counter | reason = nesting_too_deep (body relayed without prefix hashes) |
| ``gateway_kv_events_mode``, ``gateway_kv_events_batches_total``, ``gateway_kv_events_exact_blocks`` | see `gateway.telemetry.kv_events` | backend, ... |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from gateway.telemetry import metric_values
from gateway.telemetry.kv_events import KvEventsTelemetry
from gateway.telemetry.pd import PdTelemetry
from router.kappa import Regime
from router.kappa_fit import KappaCritMeasurement
from router.link_factors import FACTORS

# prometheus-client's multiprocess mode (``serve --workers``) is on when this variable names a
# directory: prometheus-client reads it when it is imported, the gateway in `gateway.app.create_app`
# (passed here as ``multiprocess_dir``). Gauges then combine over workers by their
# ``multiprocess_mode`` (livesum: loads add up; mostrecent: the last value any worker wrote).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Seconds between a worker's writes of its callback gauges and write-behind values (multiprocess
# mode): a Prometheus scrape interval is 15-60 s, so the others' figures are at most 1 s old in it.
REFRESH_INTERVAL_S = 1.0

# 0.01 … 1e5, 3 buckets per decade: κ_ratio spans 7 decades (REFERENCE.md §1: Mooncake p99 ≈ 890,
# document QA ≈ 10,000).
KAPPA_BUCKETS = tuple(round(m * 10.0**e, 6) for e in range(-2, 5) for m in (1, 2, 5)) + (1e5,)
# Latency buckets from 1 ms to 1 h: TTFT of a 128k prefill behind a queue, E2E of long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80,
                   160, 320, 640, 1200, 2400, 3600)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)

# The closed sets of ``gateway_requests_total``'s labels (created at 0 by `Telemetry.init_requests`).
REGIMES = tuple(r.value for r in Regime)
# What `gateway.proxy.relay.Relay.settle` records for a request a backend answered.
RELAYED_OUTCOMES = ("ok", "client_disconnect", "shutdown", "upstream_timeout", "upstream_error", "upstream_4xx")
# What `gateway.proxy.handler.proxy` records, under backend "none", for requests the gateway answered itself
# (`gateway.errors`: bad request, unknown model, body too large, upstream failure, unavailable, timeout).
GATEWAY_ERROR_STATUSES = ("400", "401", "404", "413", "415", "500", "502", "503", "504", "client_disconnect")


class Telemetry:
    """Every gateway metric, registered on ``registry``.

    Args:
        registry: where to register (a fresh `CollectorRegistry` per app, so two apps in one
            process — tests — never collide).
        multiprocess_dir: prometheus-client's multiprocess directory (``MULTIPROC_DIR_ENV``,
            ``serve --workers``), or None: one process, callback gauges read when scraped.
    """

    def __init__(self, registry: CollectorRegistry, *, multiprocess_dir: str | None = None) -> None:
        self.registry = registry
        self.multiprocess_dir = multiprocess_dir
        self.multiprocess = multiprocess_dir is not None
        self._declare_request_metrics(registry)
        self._declare_token_metrics(registry)
        self._declare_latency_metrics(registry)
        self._declare_backend_metrics(registry)
        self._declare_index_metrics(registry)
        self._declare_edge_metrics(registry)
        self.pd = PdTelemetry(registry)  # P/D disaggregation (gateway.telemetry.pd)
        self.kv_events = KvEventsTelemetry(registry)  # the KV-event subscribers (gateway.telemetry.kv_events)
        self._backends: dict[str, BackendSeries] = {}
        self._functions: list[tuple[Gauge, Callable[[], float]]] = []
        self._outcomes: dict[tuple[str, str, str, str, str], object] = {}

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """Outcomes and the κ figures of routed requests, and the time to decide."""
        self.requests = Counter("gateway_requests", "Requests by outcome.",
                                ["backend", "model", "policy", "regime", "status"], registry=r)
        self.decision_seconds = Histogram("gateway_routing_decision_seconds",
                                          "Time to rank the candidates (index lookup excluded).", ["policy"],
                                          buckets=DECISION_BUCKETS, registry=r)
        self.kappa_ratio = Histogram("gateway_kappa_ratio", "κ_ratio = K/T of routed requests on the chosen backend: "
                                     "every cached prompt token (HBM, host tier, KV pool) over the uncached ones.",
                                     ["backend"], buckets=KAPPA_BUCKETS, registry=r)
        self.kappa_ratio_loaded = Histogram("gateway_kappa_ratio_loaded", "κ_ratio_loaded = K_loaded/T of routed "
                                            "requests on the chosen backend: host-tier and KV-pool tokens (the KV "
                                            "that must be loaded) over the uncached ones; the regime compares it "
                                            "with the request's κ_crit.", ["backend"], buckets=KAPPA_BUCKETS, registry=r)
        self.kappa_crit_linear = Gauge("gateway_kappa_crit_linear", "κ_crit_linear = κ_M·κ_HW per backend (linear "
                                       "F_pf, host link, T-independent): predicted from profiles; measured "
                                       "(router.kappa_fit: the backend's own prefill times against the cost model) "
                                       "once it has enough compute- and load-bound requests.",
                                       ["backend", "kind"], multiprocess_mode="mostrecent", registry=r)
        self.kappa_crit_interval = Gauge("gateway_kappa_crit_linear_measured_interval",
                                         "95% confidence interval of the measured κ_crit_linear (router.kappa_fit).",
                                         ["backend", "bound"], multiprocess_mode="mostrecent", registry=r)
        self.kappa_fit_samples = Gauge("gateway_kappa_fit_requests", "Requests behind the measured κ_crit_linear: "
                                       "compute-bound and load-bound prefills the fit used (router.kappa_fit).",
                                       ["backend", "kind"], multiprocess_mode="mostrecent", registry=r)
        self.profile_deviation = Gauge("gateway_backend_profile_deviation_ratio", "Measured over profiled seconds of "
                                       "one resource of a backend (router.link_factors: compute, host_link, "
                                       "kv_pool_link, hbm; 1 = the profile, 2 = twice as slow), once measured.",
                                       ["backend", "factor"], multiprocess_mode="mostrecent", registry=r)

    def _declare_token_metrics(self, r: CollectorRegistry) -> None:
        """Prompt tokens by where the index expected them, cached tokens predicted vs reported, and the
        tokens prefix invalidation costs."""
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens routed, by where the index expected them.",
                                     ["backend", "source"], registry=r)
        self.cached_estimated = Counter("gateway_cached_tokens_estimated",
                                        "Cached prompt tokens the index predicted (requests with reported usage).",
                                        ["backend"], registry=r)
        self.cached_reported = Counter("gateway_cached_tokens_reported",
                                       "Cached prompt tokens the backend reported (usage.prompt_tokens_details).",
                                       ["backend"], registry=r)
        self.invalidated_tokens = Counter(
            "gateway_prefix_invalidated_tokens", "Prompt tokens re-prefilled because a chat request rewrote the front "
            "or middle of an earlier request's context (prefix_index.invalidation: the earlier messages it repeated "
            "after the change, which an append-only context would have had as prefix hits), by cause.",
            ["model", "cause"], registry=r)
        self.invalidations = Counter("gateway_prefix_invalidations", "Chat requests that rewrote the front or middle "
                                     "of an earlier request's context, by cause (prefix_index.invalidation).",
                                     ["model", "cause"], registry=r)

    def _declare_latency_metrics(self, r: CollectorRegistry) -> None:
        """Latencies seen from the gateway: TTFT, response headers, ITL, end to end."""
        self.ttft = Histogram("gateway_ttft_seconds", "Streamed requests only: time from receipt to the first "
                              "content chunk. A non-streamed answer has no first-token time: see "
                              "gateway_time_to_response_headers_seconds{stream=\"false\"}.", ["backend"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.response_headers = Histogram(
            "gateway_time_to_response_headers_seconds", "Time from receipt to the backend's response headers "
            "(answered requests, retries included). stream=false: vLLM sends them with the whole answer, so this "
            "is its time to the complete response; stream=true: it sends them once the request is tokenised and "
            "queued, so this is the time before the queue and prefill (TTFT minus this is the backend's own).",
            ["backend", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gateway_itl_seconds", "Time between streamed chunks.", ["backend"],
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gateway_e2e_seconds", "Time from receipt to the last byte.", ["backend"],
                             buckets=LATENCY_BUCKETS, registry=r)

    def _declare_backend_metrics(self, r: CollectorRegistry) -> None:
        """Per-backend load, health and upstream failures."""
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests sent and not finished (the ledger).",
                               ["backend"], multiprocess_mode="livesum", registry=r)
        self.kv_demand = Gauge("gateway_kv_demand_bytes", "KV bytes charged to in-flight requests, (K+T+max_tokens)·B_kv.",
                               ["backend"], multiprocess_mode="livesum", registry=r)
        self.backend_up = Gauge("gateway_backend_up", "1 if the backend passes health checks.", ["backend"], multiprocess_mode="mostrecent", registry=r)
        self.retries = Counter("gateway_upstream_retries", "Retries after a failure before the first byte.",
                               ["backend"], registry=r)
        self.upstream_failures = Counter("gateway_upstream_failures", "Upstream failures by kind: before the "
                                         "first byte (connect-failure, reset, 5xx, timeout) or after it "
                                         "(idle-timeout, mid-stream).", ["backend", "kind"], registry=r)
        self.outlier_ejections = Counter("gateway_outlier_ejections", "Backends ejected by outlier detection "
                                         "(consecutive failed requests: 5xx, connect failures, resets, hangs).",
                                         ["backend"], registry=r)
        self.outlier_ejections_overflow = Counter("gateway_outlier_ejections_overflow", "Outliers not ejected: "
                                                  "max_ejection_percent of the model's backends were out already.",
                                                  ["backend"], registry=r)
        self.panic_mode = Gauge("gateway_panic_mode", "1 while the model is in panic mode (too few backends in "
                                "rotation: requests go to all of them).", ["model"], multiprocess_mode="mostrecent",
                                registry=r)
        self.panic_mode_entries = Counter("gateway_panic_mode_entries", "Times the model entered panic mode.",
                                          ["model"], registry=r)

    def _declare_index_metrics(self, r: CollectorRegistry) -> None:
        """The prefix index: errors, prediction quality, resets, breaker, latency, calibration."""
        self.index_errors = Counter("gateway_index_errors", "Prefix-index calls that failed or timed out.",
                                    ["op"], registry=r)
        self.index_predictions = Counter("gateway_index_predictions", "Answers with usage by how the index's "
                                         "predicted cached tokens K compared with the reported cached_tokens: "
                                         "within one index block, over or under (dispatch.evidence).",
                                         ["backend", "outcome"], registry=r)
        self.index_resets = Counter("gateway_index_resets", "Times the index forgot a holder's entries (a backend, "
                                    "or @kv-pool): a restart seen in its /metrics, answers' cached_tokens short of "
                                    "its credit again and again, or every backend sharing the KV pool restarted.",
                                    ["backend", "reason"], registry=r)
        self.index_skipped = Counter("gateway_index_skipped", "Prefix-index calls skipped because its circuit "
                                     "breaker was open (routed without prefix matches).", ["op"], registry=r)
        self.index_degraded = Gauge("gateway_index_degraded", "1 while the prefix index's circuit breaker is open "
                                    "or half-open (the index is skipped), else 0.", multiprocess_mode="livemax", registry=r)
        self.index_seconds = Histogram("gateway_index_seconds", "Prefix-index call latency.", ["op"],
                                       buckets=DECISION_BUCKETS, registry=r)
        self.bytes_per_token = Gauge("gateway_bytes_per_token", "Calibrated canonical prompt bytes per token.",
                                     ["model"], multiprocess_mode="mostrecent", registry=r)

    def _declare_edge_metrics(self, r: CollectorRegistry) -> None:
        """Replicas, the admin key and load-only routing."""
        self.peer_replicas = Gauge("gateway_peer_replicas", "Gateway replicas whose load this one saw at its last "
                                   "exchange, itself included (gateway.replicas.peer_load; 1 without Redis).", multiprocess_mode="livemax", registry=r)
        self.peer_sync_errors = Counter("gateway_peer_sync_errors", "Load exchanges with the other replicas "
                                        "that failed (Redis trouble).", registry=r)
        self.peer_replicas.set(1)
        self.admin_unauthorized = Counter("gateway_admin_unauthorized", "Requests to the admin routes (/v1/kappa/*, "
                                          "/metrics when protected) refused for a missing or wrong key.", registry=r)
        self.load_only_requests = Counter("gateway_load_only_requests", "Requests relayed with load-only routing: "
                                          "a well-formed body the prefix index cannot canonicalise, by reason.",
                                          ["reason"], registry=r)

    def init_backend(self, backend_id: str, kappa_crit_linear: float, *, in_flight: Callable[[], float],
                     kv_demand_bytes: Callable[[], float]) -> None:
        """Create a backend's series at start-up so dashboards see zeros, not gaps.

        ``in_flight`` and ``kv_demand_bytes`` are read when ``/metrics`` is scraped (the
        ledger changes twice per request; publishing each change cost CPU on the hot path).
        """
        self.kappa_crit_linear.labels(backend_id, "predicted").set(kappa_crit_linear)
        self.gauge_function(self.in_flight.labels(backend_id), in_flight)
        self.gauge_function(self.kv_demand.labels(backend_id), kv_demand_bytes)
        self.backend_up.labels(backend_id).set(0)
        for kind in ("compute", "load"):
            self.kappa_fit_samples.labels(backend_id, kind).set(0)
        self.backend(backend_id)  # its histograms and token counters, and headers time by stream

    def init_requests(self, backends: Iterable[tuple[str, str]], policy: str) -> None:
        """Create every ``gateway_requests_total`` series at 0: for each (backend id, its model),
        each regime and relayed outcome, the outcome of a client gone before the first byte;
        and the gateway's own error statuses under backend "none"."""
        for backend, model in backends:
            for regime in REGIMES:
                for outcome in RELAYED_OUTCOMES:
                    self.requests.labels(backend, model, policy, regime, outcome)
            self.requests.labels(backend, model, policy, "none", "client_disconnect")
        for status in GATEWAY_ERROR_STATUSES:
            self.requests.labels("none", "none", policy, "none", status)

    def set_kappa_fit(self, backend_id: str, measured: KappaCritMeasurement | None) -> None:
        """Publish a backend's measured κ_crit at the host link and its interval (once measured), the
        sample counts, and each measured factor's deviation from the profile."""
        if measured is None:
            return
        if measured.kappa_crit_linear is not None:
            value, low, high = measured.kappa_crit_linear
            self.kappa_crit_linear.labels(backend_id, "measured").set(value)
            self.kappa_crit_interval.labels(backend_id, "low").set(low)
            self.kappa_crit_interval.labels(backend_id, "high").set(high)
        for name, factor in zip(FACTORS, measured.factors, strict=True):
            if factor is not None:
                self.profile_deviation.labels(backend_id, name).set(factor.time_ratio)
        self.kappa_fit_samples.labels(backend_id, "compute").set(measured.compute_requests)
        self.kappa_fit_samples.labels(backend_id, "load").set(measured.load_requests)

    def gauge_function(self, child: Gauge, value: Callable[[], float]) -> None:
        """``child`` reads ``value()``: when scraped (one process), or at each `refresh`
        (prometheus-client's multiprocess mode, ``serve --workers``: a callback cannot cross
        processes, so each worker writes its value every `REFRESH_INTERVAL_S`)."""
        if self.multiprocess:
            self._functions.append((child, value))
        else:
            child.set_function(value)

    def refresh(self) -> None:
        """Write the callback gauges' values and flush the write-behind ones to their files
        (multiprocess mode, `gateway.telemetry.metric_values`; a no-op otherwise)."""
        for child, value in self._functions:
            child.set(value())
        metric_values.flush()

    def exposition(self) -> bytes:
        """The ``/metrics`` page: this registry, or with ``serve --workers`` every worker's
        series combined (`prometheus_client.multiprocess.MultiProcessCollector`)."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.refresh()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)

    def backend(self, backend_id: str) -> BackendSeries:
        """The per-request series of one backend, resolved once (``labels()`` costs µs per call)."""
        series = self._backends.get(backend_id)
        if series is None:
            series = self._backends[backend_id] = BackendSeries(self, backend_id)
        return series

    def count_request(self, backend: str, model: str, policy: str, regime: str, status: str) -> None:
        """``gateway_requests_total`` += 1; label values come from the config and closed sets."""
        key = (backend, model, policy, regime, status)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self.requests.labels(*key)
        child.inc()


class BackendSeries:
    """One backend's labelled children of the per-request metrics."""

    __slots__ = ("ttft", "itl", "e2e", "kappa_ratio", "kappa_ratio_loaded", "cached_hbm_tokens", "cached_host_tokens",
                 "cached_kv_pool_tokens", "uncached_prompt_tokens", "cached_estimated", "cached_reported",
                 "response_headers")

    def __init__(self, telemetry: Telemetry, backend_id: str) -> None:
        self.ttft = telemetry.ttft.labels(backend_id)
        self.itl = telemetry.itl.labels(backend_id)
        self.e2e = telemetry.e2e.labels(backend_id)
        self.kappa_ratio = telemetry.kappa_ratio.labels(backend_id)
        self.kappa_ratio_loaded = telemetry.kappa_ratio_loaded.labels(backend_id)
        self.cached_hbm_tokens = telemetry.prompt_tokens.labels(backend_id, "cached_hbm")
        self.cached_host_tokens = telemetry.prompt_tokens.labels(backend_id, "cached_host")
        self.cached_kv_pool_tokens = telemetry.prompt_tokens.labels(backend_id, "cached_kv_pool")
        self.uncached_prompt_tokens = telemetry.prompt_tokens.labels(backend_id, "uncached")
        self.cached_estimated = telemetry.cached_estimated.labels(backend_id)
        self.cached_reported = telemetry.cached_reported.labels(backend_id)
        # by stream: index 0 non-streamed, 1 streamed
        self.response_headers = tuple(telemetry.response_headers.labels(backend_id, s) for s in ("false", "true"))
