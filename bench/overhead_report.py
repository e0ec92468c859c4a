"""Numbers to table and verdict for `bench/overhead.py`: percentiles, derived columns, budget, facts.

Kept apart from the runner so each stays small; imports none of the project's packages.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

SIZES = ("1k", "8k", "128k")
BUDGET = {"throughput_ratio_vs_bare_proxy_redis": (">=", 0.70),
          "added_p50_ms_vs_bare_proxy_8k_redis": ("<=", 1.0),
          "added_p50_ms_vs_bare_proxy_128k_redis": ("<=", 3.0),
          "routing_decision_p50_ms_redis": ("<=", 0.3)}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def bucket_p50_ms(after: dict[float, float], before: dict[float, float] | None = None) -> float | None:
    """Median estimated from cumulative buckets (linear within the bucket), in ms."""
    bounds = sorted(after)
    cum = [after[b] - (before or {}).get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return None
    half, lower, below = cum[-1] / 2, 0.0, 0.0
    for bound, count in zip(bounds, cum):
        if count >= half:
            if bound == float("inf"):
                return lower * 1e3
            return (lower + (bound - lower) * (half - below) / max(count - below, 1e-12)) * 1e3
        lower, below = bound, count
    return None


def derive(cell: list[dict]) -> None:
    by = {row["target"]: row for row in cell}
    for row in cell:
        for base in ("direct", "bare"):
            if base in by:
                row[f"added_p50_ms_vs_{base}"] = row["p50_ms"] - by[base]["p50_ms"]
                row[f"added_p99_ms_vs_{base}"] = row["p99_ms"] - by[base]["p99_ms"]
        if "bare" in by:
            row["throughput_ratio_vs_bare"] = row["rps"] / by["bare"]["rps"]
            row["cpu_ratio_vs_bare"] = row["cpu_ms_per_request"] / by["bare"]["cpu_ms_per_request"]
        one = {"redis-w2": "redis", "bare-w2": "bare"}.get(row["target"])
        if one in by:  # 2 worker processes against 1, same cell (issue 15)
            row["throughput_ratio_vs_one_worker"] = row["rps"] / by[one]["rps"]


COLUMNS = ("size", "stream", "concurrency", "target", "p50_ms", "p99_ms", "rps", "added_p50_ms_vs_direct",
           "added_p99_ms_vs_direct", "added_p50_ms_vs_bare", "added_p99_ms_vs_bare", "throughput_ratio_vs_bare",
           "cpu_ms_per_request", "cpu_ratio_vs_bare", "decision_p50_ms", "errors")
HEADERS = ("prompt", "stream", "conc", "target", "p50 ms", "p99 ms", "req/s", "+p50 vs direct",
           "+p99 vs direct", "+p50 vs bare", "+p99 vs bare", "req/s ÷ bare",
           "server CPU ms/req", "CPU ÷ bare", "decision p50 ms", "errors")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def row_line(row: dict) -> str:
    return "| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |"


def summary(rows: list[dict], final: dict[str, dict[str, dict[float, float]]]) -> dict[str, Any]:
    def cell(size: str, conc: int, target: str, stream: bool = False) -> dict:
        return next((r for r in rows if (r["size"], r["concurrency"], r["target"], r["stream"])
                     == (size, conc, target, stream)), {})

    out: dict[str, Any] = {}
    for target in ("redis", "memory", "relay", *(t for t in final if "@" in t)):
        for suffix, stream in (("", False), ("_stream", True)):
            out[f"throughput_ratio_vs_bare_proxy_{target}{suffix}"] = cell("8k", 32, target, stream).get(
                "throughput_ratio_vs_bare")
            for size in SIZES:
                out[f"added_p50_ms_vs_bare_proxy_{size}_{target}{suffix}"] = cell(size, 1, target, stream).get(
                    "added_p50_ms_vs_bare")
        if target in final:
            for key in ("decision", "index_match", "index_record"):
                name = "routing_decision" if key == "decision" else key
                out[f"{name}_p50_ms_{target}"] = bucket_p50_ms(final[target].get(key, {}))
            out[f"index_errors_{target}"] = final[target].get("index_errors", {})
    for target in ("redis-w2", "bare-w2"):
        out[f"throughput_ratio_vs_one_worker_{target}"] = cell("8k", 32, target).get("throughput_ratio_vs_one_worker")
    out = {k: v for k, v in out.items() if v is not None}
    verdict = {}
    for key, (op, limit) in BUDGET.items():
        value = out.get(key)
        ok = None if value is None else (value >= limit if op == ">=" else value <= limit)
        verdict[key] = {"value": value, "limit": f"{op} {limit}", "ok": ok}
    out["budget"] = verdict
    out["budget_met"] = all(v["ok"] for v in verdict.values())
    return out


def machine() -> dict[str, Any]:
    versions = {}
    for pkg in ("uvicorn", "starlette", "fastapi", "aiohttp", "uvloop", "httptools", "orjson", "redis",
                "prometheus-client", "pydantic"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    redis_v = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout
    return {"nproc": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg(), "redis_server": redis_v.strip(), "packages": versions}
