"""Prometheus metrics of the mock backend, under vLLM v1's names and labels (REFERENCE.md §2).

Everything lives on the `CollectorRegistry` the caller injects (never the global one), so
several mock servers can run in one process. Series carry ``model_name`` (the served model
name) and ``engine="0"``, as vLLM's ``PrometheusStatLogger`` does.

* Gauges and counters that vLLM derives from scheduler state (requests running/waiting, KV
  usage, prefix-cache queries/hits, prompt tokens by source, preemptions, request outcomes)
  are read from the engine's live `EngineStats` at scrape time by a custom collector, so
  they always agree with the engine and are as monotonic as its counters. Energy, which the
  engine integrates up to the time asked, is held monotonic here.
* Request histograms are observed as outputs reach the server, from the engine step's
  start/end timestamps: they are in **engine seconds** (model time, not scaled by
  ``--time-scale``), so a test at time-scale 0.001 reports the latencies the modelled GPU
  would have. `RequestTiming` keeps the per-request timestamps; as in vLLM, a request's
  queue time runs to the start of the step that first scheduled it (a chunked prefill's
  first chunk, `RequestOutput.scheduled_s`) and its prefill time from there to its first token.
* ``mock_vllm:*`` series are the mock's own: power (W), energy (J), KV bytes loaded from
  the host tier and from the fleet-shared KV pool (0 without one), and how far the
  server's driver falls behind its own step schedule, in wall seconds
  (`mock_vllm.driver`): ``schedule_lag_seconds`` is the largest delay over the last
  `LAG_WINDOW_STEPS` steps, ``step_lag_seconds`` a histogram of every step's delay,
  ``schedule_step_seconds`` the mean scheduled wall duration of those steps.

Bucket boundaries follow ``vllm/v1/metrics/loggers.py``: TTFT 0.001…2560 s (22 bounds),
inter-token latency 0.01…80 s (19), request latencies 0.3…7680 s (21), token-count
histograms 1-2-5 steps up to max_model_len.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mock_vllm.types import RequestOutput, StepResult

if TYPE_CHECKING:
    from mock_vllm.engine import MockEngine

ENGINE_INDEX = "0"
LABELS = ("model_name", "engine")
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, all pre-created
# Steps over which the schedule-lag gauge takes its maximum: ≈ 1–3 s of decode at time-scale 1.
LAG_WINDOW_STEPS = 256
# Step delivery delays, wall seconds: from timer granularity (~0.3 ms) to a stalled loop.
STEP_LAG_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# vLLM's defaults for the cache_config_info labels the mock has no notion of.
CACHE_DTYPE = "auto"
PREFIX_CACHING_HASH_ALGO = "sha256"


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, … up to ``max_value`` inclusive (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(slots=True)
class RequestTiming:
    """One request's timestamps in engine seconds, filled in as its outputs arrive."""

    arrival_s: float
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None


class _EngineCollector(Collector):
    """Reads `EngineStats`, power and energy at scrape time (module docstring)."""

    def __init__(self, engine: MockEngine, model_name: str, engine_now_s: Callable[[], float]) -> None:
        self._engine = engine
        self._labels = [model_name, ENGINE_INDEX]
        self._now_s = engine_now_s
        self._energy_j = 0.0

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _by_label(self, name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=[*LABELS, label])
        for key, value in values.items():
            family.add_metric([*self._labels, key], value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, stats = self._engine, self._engine.stats
        now_s = max(self._now_s(), 0.0)
        self._energy_j = max(self._energy_j, engine.energy_j(now_s))
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          stats.num_requests_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          stats.num_requests_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          stats.kv_cache_usage_ratio)
        config = engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                    "num_cpu_blocks", "num_gpu_blocks", "prefix_caching_hash_algo", "engine"],
        )
        info.add_metric([str(config.block_size_tokens), CACHE_DTYPE, "True", str(config.gpu_memory_utilization),
                         str(stats.num_host_blocks), str(stats.num_gpu_blocks), PREFIX_CACHING_HASH_ALGO,
                         ENGINE_INDEX], 1.0)
        yield info
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            stats.prefix_cache_queries_tokens)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            stats.prefix_cache_hits_tokens)
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries (host tier and shared KV pool), in queried tokens.",
                            stats.external_prefix_cache_queries_tokens)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits (host tier and shared KV pool), in cached tokens.",
                            stats.external_prefix_cache_hits_tokens)
        by_source = stats.prompt_tokens_by_source
        yield self._by_label("vllm:prompt_tokens_by_source", "Prompt tokens by source.", "source", dict(by_source))
        yield self._by_label("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by cache tier.", "source",
                             {"device": by_source.get("local_cache_hit", 0),
                              "host": by_source.get("external_kv_transfer", 0)})
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            stats.generation_tokens_total)
        reasons = dict.fromkeys(FINISH_REASONS, 0) | dict(stats.request_success_total)
        yield self._by_label("vllm:request_success", "Count of successfully processed requests.",
                             "finished_reason", reasons)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            stats.num_preemptions_total)
        yield self._gauge("mock_vllm:power_watts", "Modelled board power now, W.", engine.power_w(now_s))
        yield self._counter("mock_vllm:energy_joules", "Modelled energy since engine start (idle included), J.",
                            self._energy_j)
        yield self._counter("mock_vllm:host_kv_loaded_bytes", "KV bytes loaded from the host tier.",
                            stats.host_kv_loaded_bytes_total)
        yield self._counter("mock_vllm:kv_pool_loaded_bytes", "KV bytes loaded from the fleet-shared KV pool.",
                            stats.kv_pool_loaded_bytes_total)


class MockVllmMetrics:
    """The mock server's metrics on one injected registry (module docstring).

    Args:
        registry: where every series is registered; use a fresh one per app.
        engine: the engine whose stats the scrape-time collector reads.
        model_name: value of the ``model_name`` label (the served model name).
        engine_now_s: the server's engine clock, engine seconds (for power and energy).
    """

    def __init__(self, registry: CollectorRegistry, engine: MockEngine, *, model_name: str,
                 engine_now_s: Callable[[], float]) -> None:
        registry.register(_EngineCollector(engine, model_name, engine_now_s))
        labels = (model_name, ENGINE_INDEX)
        max_len = engine.max_model_len_tokens

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds (engine time).", TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds (engine time).", ITL_BUCKETS_S)
        latency = REQUEST_LATENCY_BUCKETS_S
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             latency)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", latency)
        token_buckets = buckets_1_2_5(max_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", token_buckets)
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "New KV tokens computed during prefill (excluding cached tokens).", token_buckets)
        self._start_time = Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                                 registry=registry)
        self._lag = Gauge("mock_vllm:schedule_lag_seconds",
                          f"Largest delay of a step's delivery behind its wall-clock schedule over the last "
                          f"{LAG_WINDOW_STEPS} steps, wall seconds.", LABELS, registry=registry).labels(*labels)
        self._step_wall = Gauge("mock_vllm:schedule_step_seconds",
                                f"Mean scheduled wall-clock duration of the last {LAG_WINDOW_STEPS} steps "
                                f"(engine duration x time scale), wall seconds.", LABELS,
                                registry=registry).labels(*labels)
        self._lag_hist = Histogram("mock_vllm:step_lag_seconds",
                                   "Delay of each step's delivery behind its wall-clock schedule, wall seconds.",
                                   LABELS, buckets=STEP_LAG_BUCKETS_S, registry=registry).labels(*labels)
        self._lags_s: deque[float] = deque(maxlen=LAG_WINDOW_STEPS)
        self._step_walls_s: deque[float] = deque(maxlen=LAG_WINDOW_STEPS)

    def mark_started(self) -> None:
        """Set ``process_start_time_seconds`` to now (Unix time), at server start."""
        self._start_time.set(time.time())

    def on_step(self, *, lag_s: float, step_wall_s: float) -> None:
        """Record one delivered step: its delivery lag and scheduled duration, wall seconds."""
        lag_s = max(lag_s, 0.0)  # a timer may fire a fraction of a millisecond early
        self._lag_hist.observe(lag_s)
        self._lags_s.append(lag_s)
        self._step_walls_s.append(step_wall_s)
        self._lag.set(max(self._lags_s))
        self._step_wall.set(sum(self._step_walls_s) / len(self._step_walls_s))

    def on_output(self, timing: RequestTiming, result: StepResult, output: RequestOutput) -> None:
        """Advance ``timing`` by one output of ``result``; observe TTFT/ITL and, at the end, the rest.

        Aborted requests produce no output, so they appear only in
        ``vllm:request_success{finished_reason="abort"}`` (from the engine's stats).
        """
        if timing.scheduled_s is None:  # first scheduled (a chunked prefill's first chunk), as vLLM times it
            timing.scheduled_s = output.scheduled_s if output.scheduled_s is not None else result.start_s
        if output.new_token_ids:
            if timing.first_token_s is None:
                timing.first_token_s = result.end_s
                self.ttft.observe(result.end_s - timing.arrival_s)
            else:
                self.itl.observe(result.end_s - (timing.last_token_s or result.end_s))
            timing.last_token_s = result.end_s
        if not output.finished:
            return
        first_token_s = timing.first_token_s if timing.first_token_s is not None else result.end_s
        self.e2e.observe(result.end_s - timing.arrival_s)
        self.queue.observe(max(timing.scheduled_s - timing.arrival_s, 0.0))
        self.prefill.observe(first_token_s - timing.scheduled_s)
        self.decode.observe(result.end_s - first_token_s)
        self.prompt_tokens.observe(output.prompt_tokens)
        self.generation_tokens.observe(output.completion_tokens)
        self.prefill_kv_computed.observe(output.prompt_tokens - output.cached_tokens)
