"""Read a vLLM ``/metrics`` page into the few figures routing needs.

Names and meanings from vLLM's v1 metrics (``vllm/v1/metrics/loggers.py``, REFERENCE.md §2).
Samples are matched by their own names (counters end in ``_total``), whatever the family
headers say. Series are summed over the ``engine`` label (a data-parallel server exports one per engine).

Only the lines of the samples read here go to prometheus-client's parser (`SAMPLES_READ`; comment
lines are dropped, so their families parse as untyped, which leaves sample names as they are):
most of a vLLM page is histogram buckets the gateway does not read, and every gateway worker
scrapes every backend each ``scrape_interval_s`` (the cost is measured by `bench/scrape_parse.py`,
BENCHMARKS.md). An error page is a failed scrape, never an engine whose counters read zero
(which `gateway.backends.backend_set` would take for a restart): a line that cannot be a sample (it starts
with neither a metric name nor ``#``: HTML, JSON) still goes to the parser, which refuses it, and
a page without any ``vllm:`` sample read here (empty, comments only, only
``process_start_time_seconds``, plain text) raises. A malformed line of a family not read here
is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from dispatch import BackendMetrics

# The samples parse_vllm_metrics reads, by sample name.
SAMPLES_READ = frozenset({
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "process_start_time_seconds",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:request_prefill_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
    "vllm:prompt_tokens_by_source_total",  # its external_kv_transfer source: tokens loaded (dispatch.tier_check)
    # P/D: the KV connector's pulls (vLLM's NixlConnector metrics; gateway.backends.pd_links)
    "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_num_failed_transfers_total",
})
_PREFIXES = tuple(sorted(SAMPLES_READ))
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # the exposition format's metric name
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")


def parse_vllm_metrics(text: str) -> BackendMetrics:
    """Parse Prometheus text exposition from a vLLM (or compatible) server.

    Raises:
        ValueError: a line of a sample read here, or one that cannot start a sample, is not valid
            exposition format; or the page has no ``vllm:`` sample read here (module docstring).
    """
    return read_families(text_string_to_metric_families(_lines_read(text)))


def read_families(families: Iterable[Metric]) -> BackendMetrics:
    """The figures of parsed metric families (`parse_vllm_metrics` without its line filter)."""
    waiting = running = 0.0
    usage: list[float] = []
    block_size = num_blocks = start = None
    queries = hits = prompt = generation = succeeded = 0.0
    prefill_count: float | None = None
    prefill_sum = 0.0
    xfer: dict[str, float] = {}  # the KV connector's samples (P/D) and the tokens it loaded, by name
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif name == "vllm:num_requests_running":
                running += sample.value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(sample.value)
            elif name == "vllm:cache_config_info":
                block_size = _int_label(sample.labels, "block_size", block_size)
                num_blocks = _int_label(sample.labels, "num_gpu_blocks", num_blocks)
            elif name == "process_start_time_seconds":
                start = sample.value
            elif name == "vllm:prefix_cache_queries_total":
                queries += sample.value
            elif name == "vllm:prefix_cache_hits_total":
                hits += sample.value
            elif name == "vllm:prompt_tokens_total":
                prompt += sample.value
            elif name == "vllm:generation_tokens_total":
                generation += sample.value
            elif name == "vllm:request_success_total":
                succeeded += sample.value
            elif name == "vllm:request_prefill_time_seconds_count":
                prefill_count = (prefill_count or 0.0) + sample.value
            elif name == "vllm:request_prefill_time_seconds_sum":
                prefill_sum += sample.value
            elif name.startswith("vllm:nixl_") or sample.labels.get("source") == "external_kv_transfer":
                xfer[name] = xfer.get(name, 0.0) + sample.value
    return BackendMetrics(
        num_requests_waiting=int(waiting),
        num_requests_running=int(running),
        kv_cache_usage_ratio=max(usage) if usage else 0.0,
        block_size_tokens=block_size,
        num_gpu_blocks=num_blocks,
        process_start_time_s=start,
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=hits,
        prompt_tokens_total=prompt,
        generation_tokens_total=generation,
        requests_succeeded_total=succeeded,
        prefill_time_count=prefill_count,
        prefill_time_sum_s=prefill_sum,
        kv_loaded_tokens_total=xfer.get("vllm:prompt_tokens_by_source_total"),
        kv_transfer_count=xfer.get("vllm:nixl_xfer_time_seconds_count"),
        kv_transfer_seconds_total=xfer.get("vllm:nixl_xfer_time_seconds_sum", 0.0),
        kv_transfer_bytes_total=xfer.get("vllm:nixl_bytes_transferred_sum", 0.0),
        kv_transfer_failures_total=xfer.get("vllm:nixl_num_failed_transfers_total", 0.0),
    )


def _int_label(labels: dict[str, str], key: str, current: int | None) -> int | None:
    value = labels.get(key)
    if value is None or not value.isdigit():
        return current
    return int(value)


def _lines_read(text: str) -> str:
    """The lines of ``text`` the parser needs (module docstring): the samples of `SAMPLES_READ`, and
    any line that is not a comment and cannot start a sample.

    Raises:
        ValueError: no ``vllm:`` sample read here is on the page (an empty page, comments only, or
            only the process's start time: read as zeros, its counters would look reset).
    """
    kept: list[str] = []
    engine = False  # a vllm: sample was kept
    for line in text.split("\n"):
        stripped = line.lstrip()
        if not stripped or stripped[0] == "#":
            continue
        if stripped[0] not in _NAME_START:
            kept.append(line)  # not a sample: the parser says why
        elif stripped.startswith(_PREFIXES):
            name = _METRIC_NAME.match(stripped)
            if name is not None and name.group() in SAMPLES_READ:
                kept.append(line)
                engine = engine or stripped.startswith("vllm:")
    if not engine:
        raise ValueError("no vLLM engine sample the gateway reads on this page (empty, or not a vLLM /metrics page)")
    kept.append("")
    return "\n".join(kept)
