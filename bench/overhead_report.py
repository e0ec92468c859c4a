"""Numbers to table and verdict for `bench/overhead.py`: percentiles, derived columns, budget, facts.

Kept apart from the runner so each stays small; imports none of the project's packages.
``python bench/overhead_report.py RESULT.json`` prints a saved run's "peers side by side"
table (the one in BENCHMARKS.md) and its throughput ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from peer_routers import PEER_ROUTERS

SIZES = ("1k", "8k", "128k")
BUDGET = {"throughput_ratio_vs_bare_proxy_redis": (">=", 0.70),
          "added_p50_ms_vs_bare_proxy_8k_redis": ("<=", 1.0),
          "added_p50_ms_vs_bare_proxy_128k_redis": ("<=", 3.0),
          "routing_decision_p50_ms_redis": ("<=", 0.3)}
SGLANG_CACHE_AWARE = "sglang-cache"  # the peer the gateway's throughput is compared with (issue 14)
GATEWAYS = ("redis", "memory")


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
            # and the median of each round's ratio: the two ran minutes apart at most, so a slow
            # phase of the shared machine that hit one round hits both sides of its ratio
            pairs = zip(row.get("rps_by_round", []), by[one].get("rps_by_round", []))
            ratios = [two / one_rps for two, one_rps in pairs if one_rps > 0]
            if ratios:
                row["throughput_ratio_vs_one_worker_paired"] = statistics.median(ratios)


def target_processes(target: str) -> int | None:
    """Event-loop processes a target runs: 2 for the ``-w2`` targets, none counted for the peer
    routers (Rust, threads), else 1."""
    if target in PEER_ROUTERS:
        return None
    return 2 if target.endswith("-w2") else 1


def cpu_arithmetic(row: dict, cores: int) -> None:
    """The CPU arithmetic of a row's ceiling, added to it: ``machine_cpu_ms_per_request`` (the
    target's CPU per request + its helpers': Redis, stub, load generator), ``cpu_ceiling_rps`` =
    ``cores`` / that (every process of the run shares the cores), ``process_ceiling_rps`` = the
    target's processes / its own CPU per request (a process runs on one core at most; None for
    the peers), ``ceiling_rps`` = the lower of the two. Rows without helpers' CPU are left alone."""
    helpers = row.get("helper_cpu_ms_per_request")
    if not helpers:
        return
    own = row["cpu_ms_per_request"]
    row["machine_cpu_ms_per_request"] = machine = own + sum(helpers.values())
    row["cpu_ceiling_rps"] = cores * 1e3 / machine
    processes = target_processes(row["target"])
    row["process_ceiling_rps"] = None if processes is None else processes * 1e3 / own
    row["ceiling_rps"] = min(x for x in (row["cpu_ceiling_rps"], row["process_ceiling_rps"]) if x is not None)


def ceiling_notes(rows: list[dict]) -> list[str]:
    """One line per target of the c = 32, 8k, non-streamed cell: its CPU per request and every
    helper's, the ceilings they set and the req/s measured against the lower one."""
    lines = []
    for r in rows:
        if (r["size"], r["concurrency"], r["stream"]) != ("8k", 32, False) or "ceiling_rps" not in r:
            continue
        helpers = " + ".join(f"{name} {_fmt(ms)}" for name, ms in r["helper_cpu_ms_per_request"].items())
        process = r["process_ceiling_rps"]
        bound = ("" if process is None else
                 f"; its {target_processes(r['target'])} process(es) alone: ≤ {_fmt(process)} req/s")
        lines.append(f"- CPU ms/request, {r['target']}: target {_fmt(r['cpu_ms_per_request'])} + {helpers} = "
                     f"{_fmt(r['machine_cpu_ms_per_request'])} → all cores: ≤ {_fmt(r['cpu_ceiling_rps'])} req/s"
                     f"{bound}; measured {_fmt(r['rps'])} ({_fmt(r['rps'] / r['ceiling_rps'])} of the lower)")
    return lines


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
    peers = [t for t in PEER_ROUTERS if cell("8k", 32, t)]
    for target in ("redis", "memory", "relay", *peers, *(t for t in final if "@" in t)):
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
        out[f"throughput_ratio_vs_one_worker_paired_{target}"] = cell("8k", 32, target).get(
            "throughput_ratio_vs_one_worker_paired")
        one, two = cell("8k", 32, target.removesuffix("-w2")), cell("8k", 32, target)
        if one.get("ceiling_rps") and two.get("ceiling_rps"):  # what the CPU arithmetic allows 2 workers
            out[f"ceiling_ratio_vs_one_worker_{target}"] = two["ceiling_rps"] / one["ceiling_rps"]
    sglang = cell("8k", 32, SGLANG_CACHE_AWARE)
    for target in GATEWAYS:  # issue 14: the gateway's req/s over sglang-router cache_aware's, same cell
        if sglang and cell("8k", 32, target):
            out[f"throughput_ratio_vs_sglang_router_{target}"] = cell("8k", 32, target)["rps"] / sglang["rps"]
    for row in rows:  # each target's CPU per request at c = 32, 8k, not streamed, and the ceilings it sets
        if (row["size"], row["concurrency"], row["stream"]) == ("8k", 32, False):
            out[f"cpu_ms_per_request_{row['target']}"] = row["cpu_ms_per_request"]
            for key in ("machine_cpu_ms_per_request", "cpu_ceiling_rps", "process_ceiling_rps", "ceiling_rps"):
                out[f"{key}_{row['target']}"] = row.get(key)
    out = {k: v for k, v in out.items() if v is not None}
    verdict = {}
    for key, (op, limit) in BUDGET.items():
        value = out.get(key)
        ok = None if value is None else (value >= limit if op == ">=" else value <= limit)
        verdict[key] = {"value": value, "limit": f"{op} {limit}", "ok": ok}
    out["budget"] = verdict
    out["budget_met"] = all(v["ok"] for v in verdict.values())
    return out


def side_by_side(rows: list[dict]) -> list[dict]:
    """One entry per target at 8k-token bodies, not streamed: req/s, its ratio to the bare
    proxy's and CPU ms per request at c = 32, p50 added over the bare proxy at c = 1, errors
    (both cells); targets in the order of the c = 32 cell."""
    def cell(conc: int) -> dict[str, dict]:
        return {r["target"]: r for r in rows if (r["size"], r["concurrency"], r["stream"]) == ("8k", conc, False)}

    c32, c1 = cell(32), cell(1)
    return [{"target": t, "rps": r["rps"], "throughput_ratio_vs_bare": r.get("throughput_ratio_vs_bare"),
             "cpu_ms_per_request": r["cpu_ms_per_request"],
             "added_p50_ms_vs_bare_c1": c1.get(t, {}).get("added_p50_ms_vs_bare"),
             "errors": r["errors"] + c1.get(t, {}).get("errors", 0)} for t, r in c32.items()]


def _label(target: str, peers: dict[str, dict]) -> str:
    names = {"direct": "upstream stub, called directly", "bare": "bare aiohttp proxy",
             "memory": "kappa-gateway, memory index", "redis": "kappa-gateway, Redis index",
             "relay": "kappa-gateway, relay only: routing memoised"}
    if target in peers:
        return f"{peers[target]['package']} {peers[target]['version']}, {peers[target]['policy']}"
    return names.get(target, target)


def side_by_side_table(report: dict) -> str:
    """The "peers side by side" Markdown table of a run (BENCHMARKS.md), from its report dict."""
    lines = ["| target | req/s (c=32) | ÷ bare | CPU ms/req (c=32) | +p50 ms vs bare (c=1) | errors |",
             "|---|---:|---:|---:|---:|---:|"]
    for e in side_by_side(report["rows"]):
        lines.append(f"| {e['target']} ({_label(e['target'], report.get('peers', {}))}) | {_fmt(e['rps'])} | "
                     f"{_fmt(e['throughput_ratio_vs_bare'])} | {_fmt(e['cpu_ms_per_request'])} | "
                     f"{_fmt(e['added_p50_ms_vs_bare_c1'])} | {e['errors']} |")
    ratios = {k: v for k, v in report.items() if k.startswith("throughput_ratio_vs_") and not k.endswith("_stream")
              and "one_worker" not in k}
    workers = [f"- `{k}`: {_fmt(v)}" for k, v in report.items() if k.startswith("ceiling_ratio_vs_one_worker_")]
    return "\n".join(lines + [""] + [f"- `{k}`: {_fmt(v)}" for k, v in ratios.items()] + ceiling_notes(report["rows"])
                     + workers)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print a saved overhead run's peers side-by-side table.")
    p.add_argument("result", type=Path, help="the JSON `bench/overhead.py --json` wrote")
    report = json.loads(p.parse_args(argv).result.read_text(encoding="utf-8"))
    print(f"`{report['command']}` at {report.get('commit', 'an unrecorded commit')}\n")
    print(side_by_side_table(report))


def source_commit(repo: Path = Path(__file__).resolve().parents[1]) -> str:
    """The short commit of the tree the bench runs from, ``-dirty`` if tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


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


if __name__ == "__main__":
    main()
