"""Gateway replicas in the simulator: does κ routing survive N gateways, and what must they share?

For each workload (the real Mooncake conversation trace, document QA, agentic coding) on the
heterogeneous fleet, κ routing runs with N = 1, 2, 4, 8 gateway replicas
(`sim.replicas.Topology`: requests spread round-robin, one shared index whose records
become visible ``--index-lag-ms`` after the first token), once with each replica's own
ledgers and in-flight chains (``local``), once with them shared (``shared``: the ideal), and
once as the live gateway shares them (``synced``: ledger totals read at each decision, chains
recorded in the index at decision time; ``synced-50ms``: the same with totals exchanged only
every 50 ms). Reports p50/p90 TTFT, prefix-hit ratio and goodput, and each row's p90 against
N = 1 with the same state.

Writes ``bench/results/replicas.json`` and prints the markdown table BENCHMARKS.md shows::

    python bench/replicas.py                  # Mooncake whole (12k requests) + 400-request workloads
    python bench/replicas.py --quick          # 1,500 Mooncake requests, 150 per workload
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from bench.routing_quality import PLAN, git_commit, load_fleets  # noqa: E402
from fleet_config.sections import DEFAULT_LOAD_SYNC_INTERVAL_S  # noqa: E402 -- the gateway's exchange period
from sim.real_traces import missing_message, real_trace_path  # noqa: E402
from sim.replicas import Topology  # noqa: E402
from sim.report import policy_report  # noqa: E402
from sim.runner import SimJob, run_jobs  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from sim.workloads import build_workload  # noqa: E402

RESULTS = REPO / "bench" / "results"
MOONCAKE = real_trace_path("mooncake")
REPLICAS = (1, 2, 4, 8)
STATES = ("local", "synced-50ms", "synced", "shared")
WORKLOADS = ("document-qa", "agentic-coding")
FLEET = "heterogeneous"


def run_workload(name: str, requests: list, rate_scale: float, lag_s: float, workers: int | None,
                 seed: int) -> list[dict[str, Any]]:
    fleets = {FLEET: load_fleets()[FLEET]}
    def topology(n: int, state: str) -> Topology:
        if state == "synced-50ms":
            return Topology(n, "synced", lag_s, sync_interval_s=DEFAULT_LOAD_SYNC_INTERVAL_S)
        return Topology(n, state, lag_s)  # type: ignore[arg-type]

    jobs = [SimJob(FLEET, "kappa", rate_scale, topology=topology(n, state)) for state in STATES for n in REPLICAS]
    results = run_jobs(requests, fleets, jobs, seed=seed, workers=workers)
    rows = []
    for job, result in zip(jobs, results, strict=True):
        report = policy_report(result)
        rows.append({"workload": name, "requests": len(requests), "rate_scale": rate_scale,
                     "replicas": job.topology.replicas,
                     "state": "synced-50ms" if job.topology.sync_interval_s else job.topology.state,
                     "index_lag_s": lag_s,
                     **{k: report[k] for k in ("ttft_p50_s", "ttft_p90_s", "prefix_hit_ratio", "goodput_rps")}})
    for row in rows:
        base = next(r for r in rows if r["state"] == row["state"] and r["replicas"] == 1)
        row["ttft_p90_vs_one_replica"] = row["ttft_p90_s"] / base["ttft_p90_s"]
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| workload | state | N | TTFT p50 s | TTFT p90 s | p90 vs N=1 | prefix hit | goodput rps |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['workload']} ({r['requests']}) | {r['state']} | {r['replicas']} | {r['ttft_p50_s']:.2f} | "
                   f"{r['ttft_p90_s']:.2f} | {r['ttft_p90_vs_one_replica']:.2f}× | {r['prefix_hit_ratio']:.3f} | "
                   f"{r['goodput_rps']:.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--index-lag-ms", type=float, default=2.0, help="record-to-visible lag of the shared index")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    lag_s = args.index_lag_ms / 1000
    rows: list[dict[str, Any]] = []
    if MOONCAKE.exists():
        trace = load_trace(MOONCAKE, limit=1500 if args.quick else None)
        rows += run_workload("mooncake", trace, 1.0, lag_s, args.workers, args.seed)
    else:
        print(f"skipping the Mooncake trace: {missing_message('mooncake')}", file=sys.stderr)
    for name in WORKLOADS:
        plan = PLAN[name]
        middle = plan.rate_scales[len(plan.rate_scales) // 2]
        requests = build_workload(name, 150 if args.quick else plan.requests, args.seed)
        rows += run_workload(name, requests, middle, lag_s, args.workers, args.seed)
    table = markdown(rows)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("replicas_quick.json" if args.quick else "replicas.json")
    out.write_text(json.dumps({"command": " ".join(["python", "bench/replicas.py", *sys.argv[1:]]),
                               "commit": git_commit(), "wall_s": round(time.perf_counter() - started, 1),
                               "rows": rows, "markdown": table}, indent=2))
    print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
