"""`bench/fuzz.py` end to end on a few bodies: it starts its fleet, sends, counts and stops.

Correctness only (the 10,000-body run is BENCHMARKS.md's): a short run must exit 0, print
the report it writes, count every body it sent once, and find nothing wrong with today's
gateway.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"
BODIES = 45
RUN_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.integration, pytest.mark.redis]


def test_a_short_fuzz_run_reports_every_body_and_no_failure(tmp_path: Path) -> None:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    out = tmp_path / "fuzz.json"
    run = subprocess.run([sys.executable, str(BENCH), "--bodies", str(BODIES), "--seed", "3", "--json", "--out",
                          str(out), "--logdir", str(tmp_path / "logs")], capture_output=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    report = json.loads(run.stdout)
    assert report == json.loads(out.read_text())
    assert report["sent"] == BODIES == sum(report["status_counts"].values())
    assert sum(sum(counts.values()) for counts in report["by_route"].values()) == BODIES
    assert (report["gateway_5xx"], report["non_openai_error_bodies"], report["resets"]) == (0, 0, 0)
    assert all(report["final_ok"].values()) and report["gateway_alive"] and report["problems"] == []
