"""Closed-loop HTTP load from ``wrk`` (C, one thread), in place of `bench/loadgen.py`.

``bench/overhead.py --loadgen wrk`` runs one of these per measurement cell. The load is the
same as `loadgen.py`'s: ``concurrency`` keep-alive connections, one request in flight each,
the bodies of ``bodies_file`` POSTed in turn (`loadgen_wrk.lua`) with the same headers. What
differs is the load generator's own CPU: wrk's event loop is C, so it takes less CPU per
request than `loadgen.py` (Python, uvloop), CPU the servers under test share on a 2-core
machine (measured in BENCHMARKS.md, "`serve --workers 2`"). wrk counts time, not
requests: a warm-up run of ``WARMUP_S`` seconds, then one of ``max_s`` rounded up to whole
seconds (wrk's ``-d`` takes whole units). Latencies are wrk's, per request at 1 µs resolution,
from the first byte written to the end of the response.

Returns the dict `loadgen.py` writes: latencies_s (the measured requests', expanded from
wrk's histogram, ascending; it also holds the answers that landed as wrk stopped, which
wrk's request count omits), elapsed_s, completed (wrk's count, as its req/s), warmup,
errors (socket errors and non-2xx/3xx answers), statuses ({"2xx/3xx": n, "other": n}: wrk does
not count per status code).

Raises:
    FileNotFoundError: ``wrk`` is not installed (``apt-get install wrk``).
    RuntimeError: wrk failed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SCRIPT = BENCH_DIR / "loadgen_wrk.lua"
WARMUP_S = 1


def available() -> bool:
    """Whether ``wrk`` is on PATH."""
    return shutil.which("wrk") is not None


def _wrk(port: int, path: str, bodies_file: Path, concurrency: int, seconds: int, out: Path) -> dict:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise FileNotFoundError("wrk is not installed (apt-get install wrk)")
    env = {**os.environ, "BODIES_FILE": str(bodies_file), "WRK_OUT": str(out), "WRK_PATH": path}
    done = subprocess.run([wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "30s", "-s", str(SCRIPT),
                           f"http://127.0.0.1:{port}"], env=env, capture_output=True, timeout=seconds + 60,
                          check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")
    result = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    return result


def run(port: int, path: str, bodies_file: Path, concurrency: int, max_s: float) -> dict:
    """A warm-up run, then the measured one (module docstring)."""
    out = bodies_file.with_suffix(".wrk.json")
    warm = _wrk(port, path, bodies_file, concurrency, WARMUP_S, out)
    measured = _wrk(port, path, bodies_file, concurrency, max(1, math.ceil(max_s)), out)
    latencies = [value / 1e6 for value, count in measured["latency_us"] for _ in range(count)]
    status_errors = measured["errors"]["status"]
    errors = sum(measured["errors"].values())
    return {"latencies_s": latencies, "elapsed_s": measured["duration_us"] / 1e6, "completed": measured["requests"],
            "warmup": warm["requests"], "errors": errors,
            "statuses": {"2xx/3xx": measured["requests"] - status_errors, "other": status_errors}}
