"""A backend restarted when its process start time changes or its prefix-cache counters go backwards."""

from __future__ import annotations

import pytest

from dispatch import BackendMetrics
from gateway.backends import _restarted


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
    # The first scrape (nothing to compare with) is never a restart.
    (BackendMetrics(), BackendMetrics(process_start_time_s=100.0, prefix_cache_queries_tokens=0), False),
], ids=["counters-grow", "start-time-changed", "counter-backwards", "counter-backwards-no-start-time", "idle",
        "first-scrape"])
def test_restarted(previous: BackendMetrics, current: BackendMetrics, expected: bool) -> None:
    assert _restarted(previous, current) is expected
