"""Read a vLLM ``/metrics`` page into the few figures routing needs.

Names and meanings from vLLM's v1 metrics (``vllm/v1/metrics/loggers.py``, REFERENCE.md §2).
Samples are matched by their own names (counters end in ``_total``), whatever the family
headers say. Series are summed over the ``engine`` label (a data-parallel server exports one per engine).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dispatch import BackendMetrics


def parse_vllm_metrics(text: str) -> BackendMetrics:
    """Parse Prometheus text exposition from a vLLM (or compatible) server.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    waiting = running = 0.0
    usage: list[float] = []
    block_size = num_blocks = start = None
    queries = hits = prompt = generation = succeeded = 0.0
    prefill_count: float | None = None
    prefill_sum = 0.0
    for family in text_string_to_metric_families(text):
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
    )


def _int_label(labels: dict[str, str], key: str, current: int | None) -> int | None:
    value = labels.get(key)
    if value is None or not value.isdigit():
        return current
    return int(value)
