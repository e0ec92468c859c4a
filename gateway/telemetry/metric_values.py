"""Metric values for a ``serve --workers`` worker: kept in memory, written to the shared files about once a second.

In prometheus-client's multiprocess mode every ``inc``/``set``/``observe`` writes its value into
the process's mmapped ``<type>_<pid>.db`` file at once (prometheus-client 0.26 ``values.py``,
``MmapedValue``: a lock, a dict lookup of the key's offset, a ``struct.pack_into``), so that
``MultiProcessCollector`` can read every worker's values from the files. A gateway request makes
many such updates (its histograms write a bucket and the sum each), a cost measured in
BENCHMARKS.md ("`serve --workers 2`").

`install` makes the metrics a worker creates from then on keep their value in memory and write
it to the file only at `flush`: a value updated since the last flush is written once, whatever
the number of updates. The gateway flushes every ``REFRESH_INTERVAL_S`` (1 s, with the
callback gauges it writes then: `gateway.telemetry.metrics.Telemetry.refresh`), before its own
``/metrics`` page, and when the worker stops. So:

- ``/metrics`` served by a worker shows its own values exactly and the other workers' as of
  their last flush, at most ~1 s old (a Prometheus scrape interval is 15–60 s);
- a worker killed with SIGKILL loses the updates since its last flush (≤ 1 s of its counts;
  its in-flight requests are lost with it anyway); a worker that stops cleanly loses none.

The value class is prometheus-client's own ``MultiProcessValue`` class (the pid read once:
`gateway.serving.workers.metrics_pid_read_once`), with only its two writing methods
deferred; reading (``get``), the file names and the collector are prometheus-client's.
Single-threaded by design, as the worker's event loop is: an update from another thread
between a flush's swap and its writes is kept for the next flush, never lost.
"""

from __future__ import annotations

from typing import Any

__all__ = ["flush", "install"]

_dirty: set[Any] = set()  # values updated since the last flush


def install(pid: int) -> None:
    """Make the metrics created from now on in this process write-behind values named by
    ``pid`` (module docstring). Only in prometheus-client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set), before any metric exists, in a process that will not
    fork (a forked child would write its parent's pid's file)."""
    from prometheus_client import values

    base = values.MultiProcessValue(process_identifier=lambda: pid)

    class WriteBehindValue(base):  # type: ignore[misc, valid-type]
        """prometheus-client's ``MmapedValue`` whose ``inc`` and ``set`` write at `flush`."""

        def inc(self, amount: float) -> None:
            self._value += amount
            self._timestamp = 0.0
            _dirty.add(self)

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0
            _dirty.add(self)

    values.ValueClass = WriteBehindValue


def flush() -> None:
    """Write every value updated since the last flush to its file (a no-op when none was, or
    without `install`)."""
    if not _dirty:
        return
    dirty = list(_dirty)
    _dirty.clear()
    for value in dirty:
        value._file.write_value(value._key, value._value, value._timestamp)
