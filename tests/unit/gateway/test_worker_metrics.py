"""A ``serve --workers`` worker's metrics read its pid once and write their files at a flush, not at
every update (`gateway.serving.workers`, `gateway.telemetry.metric_values`).

prometheus-client's multiprocess mode asks ``os.getpid()`` at each ``inc``/``observe`` to notice a
fork; a spawned worker never forks, so `metrics_pid_read_once` has it read the pid once. Two real
processes (one with it, one without) update real metrics in one ``PROMETHEUS_MULTIPROC_DIR``; the
parent counts what each did and reads the combined page as ``/metrics`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess

from tests.reliability.relay_support import REPO_ROOT

UPDATES = 1000

WORKER = f"""
import json, os, sys
if sys.argv[1] == "read-once":
    from gateway.serving.workers import metrics_pid_read_once
    metrics_pid_read_once()
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
registry = CollectorRegistry()
requests = Counter("requests", "r", registry=registry)
e2e = Histogram("e2e_seconds", "e", buckets=(0.1, 1.0), registry=registry)
in_flight = Gauge("in_flight", "i", multiprocess_mode="livesum", registry=registry)
calls = writes = 0
def count(frame, event, arg):
    global calls, writes
    if event == "c_call" and arg is os.getpid:
        calls += 1
    elif event == "call" and frame.f_code.co_name == "write_value":
        writes += 1
sys.setprofile(count)
for _ in range({UPDATES}):
    requests.inc()
    e2e.observe(0.5)
    in_flight.set(3)
sys.setprofile(None)
updates_writes = writes
if sys.argv[1] == "read-once":
    from gateway.telemetry import metric_values
    sys.setprofile(count)
    metric_values.flush()
    metric_values.flush()  # nothing changed since: writes nothing
    sys.setprofile(None)
print(json.dumps({{"pid": os.getpid(), "getpid_calls": calls, "update_writes": updates_writes,
                  "flush_writes": writes - updates_writes}}))
"""


def run_worker(mode: str, metrics_dir: Path) -> dict:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    done = subprocess.run([sys.executable, "-c", WORKER, mode], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_a_worker_reads_its_pid_once_writes_at_flush_and_the_workers_metrics_still_add_up(tmp_path: Path) -> None:
    default = run_worker("default", tmp_path)
    once = run_worker("read-once", tmp_path)
    # Without it, every update of a counter, histogram (sum and bucket) and gauge asks the kernel
    # and writes its file ...
    assert default["getpid_calls"] >= 4 * UPDATES
    assert default["update_writes"] == 4 * UPDATES
    assert once["getpid_calls"] == 0
    # ... with it, the updates write nothing; the flush writes each updated value once: the
    # counter, the histogram's sum and its one bucket hit, the gauge (gateway.telemetry.metric_values).
    assert once["update_writes"] == 0
    assert once["flush_writes"] == 4
    # Each process's files still carry its own pid (what the supervisor's mark_process_dead names) ...
    for pid in (default["pid"], once["pid"]):
        assert (tmp_path / f"counter_{pid}.db").exists()
        assert (tmp_path / f"histogram_{pid}.db").exists()
        assert (tmp_path / f"gauge_livesum_{pid}.db").exists()
    # ... and the page every worker serves adds them up.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("requests_total") == 2 * UPDATES
    assert registry.get_sample_value("e2e_seconds_count") == 2 * UPDATES
    assert registry.get_sample_value("e2e_seconds_bucket", {"le": "1.0"}) == 2 * UPDATES
    assert registry.get_sample_value("e2e_seconds_sum") == 2 * UPDATES * 0.5
    assert registry.get_sample_value("in_flight") == 3 + 3
    multiprocess.mark_process_dead(once["pid"], path=str(tmp_path))  # a worker that died: its live gauge leaves
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("in_flight") == 3
