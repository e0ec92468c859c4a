"""bench/index_redis_cpu.py runs end to end against a real redis-server: correctness only, no timed assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "index_redis_cpu.py"


@pytest.mark.redis
def test_the_redis_cpu_bench_reports_every_phase_with_coalesced_calls(redis_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parents[1]), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(BENCH), "--redis-url", redis_url, "--rounds", "1", "--json"],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["blocks"] == 127
    assert Path(result["prefix_index"]) == BENCH.parents[1] / "prefix_index"
    for phase in ("record, moved", "record, on top", "match"):
        assert result[phase]["calls_per_evalsha"] == pytest.approx(4.0, abs=0.5), phase  # GROUP calls share one
        assert result[phase]["script_us"] > 0 and result[phase]["process_us"] > 0, phase
    for phase in ("zadd floor, moved", "zadd floor, in place"):
        assert result[phase]["command_us"] > 0
