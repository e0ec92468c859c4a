"""A backend restarted when its process start time changes or one of vLLM's counters goes backwards."""

from __future__ import annotations

import pytest

from dispatch import BackendMetrics
from gateway.backends.backend_set import _restarted


@pytest.mark.parametrize(("previous", "current", "expected"), [
    (BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000),
     BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=6_000), False),
    (BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000),
     BackendMetrics(process_start_time_s=160.0, prefix_cache_queries_tokens=6_000), True),
    # Faster than a scrape interval, the start time may be unexported or the same second: the
    # counter that went backwards still tells.
    (BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000),
     BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=40), True),
    (BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000),
     BackendMetrics(process_start_time_s=None, prefix_cache_queries_tokens=40), True),
    (BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000),
     BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=5_000), False),
    # vLLM with several API server processes (Prometheus multiprocess mode) exports no
    # process_start_time_seconds at all: the counters must still tell (they did not before).
    (BackendMetrics(prefix_cache_queries_tokens=5_000, prompt_tokens_total=9_000),
     BackendMetrics(prefix_cache_queries_tokens=40, prompt_tokens_total=40), True),
    (BackendMetrics(prefix_cache_queries_tokens=5_000, prompt_tokens_total=9_000),
     BackendMetrics(prefix_cache_queries_tokens=5_100, prompt_tokens_total=9_100), False),
    # Prefix caching off: the prefix-cache counters stay at 0, the others still go backwards.
    (BackendMetrics(process_start_time_s=100.0, prompt_tokens_total=9_000, generation_tokens_total=300,
                    requests_succeeded_total=12),
     BackendMetrics(process_start_time_s=100.0, prompt_tokens_total=9_500, generation_tokens_total=310,
                    requests_succeeded_total=11), True),
    (BackendMetrics(process_start_time_s=100.0, generation_tokens_total=300),
     BackendMetrics(process_start_time_s=100.0, generation_tokens_total=20), True),
    # The first scrape (nothing to compare with) is never a restart.
    (BackendMetrics(), BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=0), False),
    (BackendMetrics(), BackendMetrics(prompt_tokens_total=9_000), False),
], ids=["counters-grow", "start-time-changed", "counter-backwards", "counter-backwards-no-start-time", "idle",
        "no-start-time-exported", "no-start-time-counters-grow", "requests-succeeded-backwards",
        "generation-tokens-backwards", "first-scrape", "first-scrape-no-start-time"])
def test_restarted(previous: BackendMetrics, current: BackendMetrics, expected: bool) -> None:
    assert _restarted(previous, current) is expected
