"""The live routing bench's setting in the simulator, with the live run's arrival jitter (issue 25).

`bench/routing_live.py` replays the first 400 Mooncake requests at the trace's rate through each
router in front of the demo fleet's mocks, 64 in flight. Its p90s spread by ±15% between
repetitions, and so does one simulator trajectory once each arrival is moved by Gaussian noise of
the size live runs show (50 ms). This script runs κ (with any parameters) on `--seeds` such
jittered copies of the trace, in the simulator (the real router and index, mock engines), and
prints per policy the median and range over seeds of TTFT p90, E2E p90 and E2E p50, and how far
the router's predicted TTFT was from the TTFT the engines gave (actual ÷ predicted, p50 and p90
over requests): the figures behind BENCHMARKS.md "Decode placement".

    python bench/routing_jitter.py [--policy kappa] [--params '{"interference_weight": 0}'] [--seeds 6] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

import hot_path

hot_path.select()  # an entry point: compiled or source, before the project is imported

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import load_settings  # noqa: E402
from router.policies import build_policy  # noqa: E402
from sim.fleet import fleet_from_settings  # noqa: E402
from sim.prompts import prepare_trace  # noqa: E402
from sim.real_traces import real_trace_path  # noqa: E402
from sim.report import policy_report  # noqa: E402
from sim.simulator import simulate  # noqa: E402
from sim.traces import load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JITTER_S = 0.05  # Gaussian noise per arrival, s (what live runs show)
CLIENT_CONCURRENCY = 64  # as bench/routing_live.py


def run_seed(fleet, requests, policy: str, params: dict, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    jittered = sorted((dataclasses.replace(r, arrival_s=max(0.0, r.arrival_s + rng.gauss(0, JITTER_S))) for r in requests),
                      key=lambda r: r.arrival_s)
    prepared = prepare_trace(jittered, model=fleet.served_models()[0], block_size_bytes=fleet.block_size_bytes)
    result = simulate(fleet, build_policy(policy, params), prepared, seed=0, client_concurrency=CLIENT_CONCURRENCY)
    ratios = sorted(r.ttft_s / max(r.predicted_ttft_s, 0.05) for r in result.records if r.ttft_s is not None)
    report = policy_report(result)
    return {"ttft_p90_s": report["ttft_p90_s"], "e2e_p90_s": report["e2e_p90_s"], "e2e_p50_s": report["e2e_p50_s"],
            "ttft_actual_over_predicted_p50": ratios[len(ratios) // 2],
            "ttft_actual_over_predicted_p90": ratios[int(0.9 * len(ratios))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "config" / "fleet.local.yaml")
    parser.add_argument("--policy", default="kappa")
    parser.add_argument("--params", default="{}", help="the policy's parameters, JSON")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trace = real_trace_path("mooncake")
    if not trace.is_file():
        print(f"routing_jitter: no trace at {trace} (the real traces are not in the repository)", file=sys.stderr)
        return 2
    catalog = default_catalog()
    fleet = fleet_from_settings(load_settings(args.config, catalog), catalog)
    requests = load_trace(trace, limit=args.requests)
    runs = [run_seed(fleet, requests, args.policy, json.loads(args.params), seed) for seed in range(args.seeds)]
    summary = {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                   "max": max(r[k] for r in runs)} for k in runs[0]}
    out = {"command": " ".join(sys.argv), "policy": args.policy, "params": json.loads(args.params), "runs": runs,
           "summary": summary}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:34s} median {v['median']:7.2f}  ({v['min']:.2f}–{v['max']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
