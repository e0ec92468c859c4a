"""A `gateway.serving.workers.Supervisor` whose workers ignore SIGTERM and never exit on their own.

``python -m tests.integration.stubborn_workers BOUND_S`` prints the worker pids as JSON once both
serve, then supervises them like ``serve --workers 2`` with a stop bound of ``BOUND_S``. The
supervisor's escalation (SIGKILL past the bound, exit 1) is what a test checks. Imports the
project's supervisor only; the workers run `stubborn` (a spawn target must be importable).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

from gateway.serving.workers import Supervisor


def stubborn(config: str, host: str, port: int, log_level: str, sock: object, ready: threading.Event) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the hang under test: a worker that never stops
    ready.set()
    while True:
        time.sleep(1)  # idles until killed


class StubbornSupervisor(Supervisor):
    target = staticmethod(stubborn)

    def _watch(self) -> int:
        while not all(self.ready.get(p.pid) is not None and self.ready[p.pid].is_set() for p in self.procs):
            time.sleep(0.02)  # poll interval
        print(json.dumps([p.pid for p in self.procs]), flush=True)
        return super()._watch()


if __name__ == "__main__":
    bound_s = float(sys.argv[1])
    raise SystemExit(StubbornSupervisor(Path("unused.yaml"), "127.0.0.1", 0, "warning", 2, stop_bound_s=bound_s).run())
