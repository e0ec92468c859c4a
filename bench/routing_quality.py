"""Routing quality: κ routing against the anchors' policies, by workload, fleet and load (issue 5).

For each workload (`sim.workloads.WORKLOADS`: the real Mooncake trace's first requests when
``../shared/data`` exists, the real Azure conversation trace, document QA, agentic coding,
multi-turn chat whole and under a sliding window), each fleet (config/fleets/*.yaml) and
each load (rate scales up to past the knee, per workload in `PLAN`), every policy runs in
the simulator (`sim.runner.run_jobs`: forked workers, one prepared trace per workload).
Each run is summarised by `sim.report.policy_report` (goodput at `sim.report.DEFAULT_TTFT_SLO_S`)
and compared with the TTFT lower bound (`sim.lower_bound`).

Writes ``bench/results/routing_quality.json`` (every figure of every run, the command, the
git commit), prints markdown tables (the ones BENCHMARKS.md shows; ``--markdown FILE``
also writes them to a file) and PNG plots under ``bench/results/``: TTFT CDF per policy,
p90 TTFT against load, energy per request against load.

Usage::

    python bench/routing_quality.py            # the full sweep (about 10 minutes on 2 cores)
    python bench/routing_quality.py --quick    # a smoke run: fewer requests, no plots
    python bench/routing_quality.py --middle-load --no-plots   # each workload at its middle load (~1.5 min)
    python bench/routing_quality.py --pd       # the P/D fleet, κ against the anchors' P/D rules, middle loads

``--pd`` (issue 26) runs config/fleets/disaggregated.yaml alone with `PD_POLICIES` — ``kappa``
(splits when the split pays), ``kappa-aggregated`` (never splits) and the anchors' P/D rules
``pd-always``, ``pd-llmd``, ``pd-dynamo`` — at each workload's middle load, and writes
``bench/results/routing_quality_pd.json`` and a table per workload (TTFT p90, E2E p90, ITL p50,
disaggregated share), with whether κ has the best TTFT p90 and E2E p90 of them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from fleet_config.catalog import CONFIG_DIR, default_catalog  # noqa: E402
from fleet_config.settings import load_settings  # noqa: E402
from router.policies import POLICY_NAMES  # noqa: E402
from sim.fleet import Fleet, fleet_from_settings  # noqa: E402
from sim.lower_bound import lower_bound_ratios, lower_bound_summary, lower_bound_ttfts  # noqa: E402
from sim.report import DEFAULT_TTFT_SLO_S, policy_report  # noqa: E402
from sim.runner import SimJob, run_jobs  # noqa: E402
from sim.workloads import WORKLOADS, build_workload  # noqa: E402

RESULTS = REPO / "bench" / "results"
FLEETS = ("heterogeneous", "homogeneous")
POLICIES = ("kappa", "round-robin", "least-loaded", "prefix-affinity", "weighted")
ANCHORS = tuple(p for p in POLICIES if p != "kappa")
# κ variants run beside the policies, by label: (policy, parameters). ``kappa-ttft`` is κ with the
# TTFT objective (no decode pricing): κ as it was before issue 25, to show what pricing the decode bought.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kappa-ttft": ("kappa", {"decode_weight": 0.0, "interference_weight": 0.0}),
}
RUNS = POLICIES + tuple(VARIANTS)
# ``--pd``: the P/D fleet and the policies issue 26 compares on it (κ's rivals: the rest).
PD_FLEET = "disaggregated"
PD_POLICIES = ("kappa", "kappa-aggregated", "pd-always", "pd-llmd", "pd-dynamo")
PD_RIVALS = PD_POLICIES[1:]


@dataclass(frozen=True)
class Plan:
    """One workload's sweep: requests (full and ``--quick``) and rate scales, lowest first."""

    requests: int
    quick_requests: int
    rate_scales: tuple[float, ...]


# Requests per workload are sized so every run takes a few seconds (the per-request cost grows
# with the prompt's blocks: document QA's 66k-token prompts cost ~10x a chat turn's); rate
# scales go from a light load to past the knee of the heterogeneous fleet (measured with
# kappa and least-loaded before fixing them).
PLAN: dict[str, Plan] = {
    "mooncake": Plan(700, 150, (0.5, 1.0, 2.0)),
    "azure-conv": Plan(1200, 200, (1.0, 8.0, 16.0)),
    "document-qa": Plan(400, 100, (0.25, 0.5, 1.0)),
    "agentic-coding": Plan(400, 100, (0.25, 0.5, 1.0)),
    "chat": Plan(1000, 200, (1.0, 4.0, 8.0)),
    "chat-sliding-window": Plan(1000, 200, (1.0, 4.0, 8.0)),
}


def middle_load(plan: Plan) -> float:
    """A workload's middle rate scale (of three: the second)."""
    return plan.rate_scales[len(plan.rate_scales) // 2]


def load_fleets(names: Sequence[str] = FLEETS) -> dict[str, Fleet]:
    catalog = default_catalog()
    return {name: fleet_from_settings(load_settings(CONFIG_DIR / "fleets" / f"{name}.yaml", catalog, env={}),
                                    catalog) for name in names}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + (" (uncommitted changes in the tree)" if dirty else "")


def sweep_workload(name: str, plan: Plan, fleets: dict[str, Fleet], *, quick: bool, seed: int,
                   workers: int | None, middle_only: bool = False,
                   runs: Sequence[str] = RUNS) -> list[dict[str, Any]]:
    """Every fleet × load × policy run of one workload, as JSON-ready rows (``middle_only``: its
    middle load alone, the one the issues' done-when criteria name)."""
    if middle_only:
        plan = Plan(plan.requests, plan.quick_requests, (middle_load(plan),))
    n = plan.quick_requests if quick else plan.requests
    requests = build_workload(name, n, seed)
    span_s = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    base_rps = (len(requests) - 1) / span_s if span_s > 0 else None
    labels, jobs = [], []
    for fleet in fleets:
        for scale in plan.rate_scales:
            for label in runs:
                policy, params = VARIANTS.get(label, (label, {}))
                labels.append(label)
                jobs.append(SimJob(fleet, policy, scale, params))
    results = run_jobs(requests, fleets, jobs, seed=seed, workers=workers)
    bounds = {f: lower_bound_ttfts(requests, fleets[f].backends) for f in fleets}
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for label, job, result in zip(labels, jobs, results, strict=True):
        row = rows.setdefault((job.fleet, job.rate_scale), {
            "workload": name, "fleet": job.fleet, "rate_scale": job.rate_scale,
            "rate_rps": base_rps * job.rate_scale if base_rps else None, "requests": len(requests),
            "lower_bound": lower_bound_summary(bounds[job.fleet]), "policies": {}})
        report = policy_report(result) | lower_bound_ratios(result, bounds[job.fleet])
        if job.rate_scale == middle_load(plan):  # the CDF plot's load
            report["ttfts_s"] = [round(r.first_token_s - r.arrival_s, 4) for r in result.records
                                 if r.first_token_s is not None]
        row["policies"][label] = report
    return list(rows.values())


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _ms(seconds: float | None) -> str:
    return _f(None if seconds is None else seconds * 1000, '.1f')


def markdown(runs: Sequence[dict[str, Any]]) -> str:
    """The summary table (κ against the best anchor) and one full table per workload × fleet."""
    lines = ["### κ routing against the best anchor policy (TTFT, seconds; LB = lower bound)", "",
             "| workload | fleet | load (req/s) | LB p50 / p90 | kappa p50 / p90 | best anchor by p90 | "
             "its p50 / p90 | kappa p90 ÷ anchor p90 | kappa p50÷LB / p90÷LB | anchor p50÷LB / p90÷LB |",
             "| --- | --- | --- | --- | --- | --- | --- | ---: | --- | --- |"]
    for run in runs:
        pol, lb = run["policies"], run["lower_bound"]
        best = min(ANCHORS, key=lambda a: pol[a]["ttft_p90_s"] if pol[a]["ttft_p90_s"] is not None else float("inf"))
        k, a = pol["kappa"], pol[best]
        lines.append(
            f"| {run['workload']} | {run['fleet']} | ×{run['rate_scale']:g} ({_f(run['rate_rps'], '.2f')}) | "
            f"{_f(lb['ttft_p50_s'], '.3f')} / {_f(lb['ttft_p90_s'], '.3f')} | "
            f"{_f(k['ttft_p50_s'], '.3f')} / {_f(k['ttft_p90_s'], '.3f')} | {best} | "
            f"{_f(a['ttft_p50_s'], '.3f')} / {_f(a['ttft_p90_s'], '.3f')} | "
            f"{_f(k['ttft_p90_s'] / a['ttft_p90_s'] if a['ttft_p90_s'] else None, '.2f')} | "
            f"{_f(k['ttft_p50_lower_bound_ratio'], '.1f')} / {_f(k['ttft_p90_lower_bound_ratio'], '.1f')} | "
            f"{_f(a['ttft_p50_lower_bound_ratio'], '.1f')} / {_f(a['ttft_p90_lower_bound_ratio'], '.1f')} |")
    lines += ["", "### κ routing against the best anchor policy end to end (E2E and ITL, seconds and ms)", "",
              "| workload | fleet | load (req/s) | kappa E2E p50 / p90 | best anchor by E2E p90 | its E2E p50 / p90 | "
              "kappa p90 ÷ anchor p90 | kappa ITL p50 / p90 | anchor ITL p50 / p90 | kappa-ttft E2E p90 / TTFT p90 |",
              "| --- | --- | --- | --- | --- | --- | ---: | --- | --- | --- |"]
    for run in runs:
        pol = run["policies"]
        best = min(ANCHORS, key=lambda a: pol[a]["e2e_p90_s"] if pol[a].get("e2e_p90_s") is not None else float("inf"))
        k, a = pol["kappa"], pol[best]
        lines.append(
            f"| {run['workload']} | {run['fleet']} | ×{run['rate_scale']:g} ({_f(run['rate_rps'], '.2f')}) | "
            f"{_f(k['e2e_p50_s'], '.2f')} / {_f(k['e2e_p90_s'], '.2f')} | {best} | "
            f"{_f(a['e2e_p50_s'], '.2f')} / {_f(a['e2e_p90_s'], '.2f')} | "
            f"{_f(k['e2e_p90_s'] / a['e2e_p90_s'] if a['e2e_p90_s'] else None, '.2f')} | "
            f"{_ms(k['itl_p50_s'])} / {_ms(k['itl_p90_s'])} | {_ms(a['itl_p50_s'])} / {_ms(a['itl_p90_s'])} | "
            + (f"{_f(pol['kappa-ttft']['e2e_p90_s'], '.2f')} / {_f(pol['kappa-ttft']['ttft_p90_s'], '.3f')} |"
               if "kappa-ttft" in pol else "– |"))
    header = ("| load | policy | TTFT p50 | p90 | p99 | E2E p50 | E2E p90 | ITL p50 ms | ITL p90 ms | req/s | goodput | "
              "hit | host hit | J/req | compute / transfer | ÷LB p50 | ÷LB p90 | ÷LB mean |")
    by_pair: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        by_pair.setdefault((run["workload"], run["fleet"]), []).append(run)
    for (workload, fleet), group in by_pair.items():
        lb = group[0]["lower_bound"]
        lines += ["", f"#### {workload} on {fleet} ({group[0]['requests']} requests; lower bound p50 "
                      f"{_f(lb['ttft_p50_s'], '.3f')} s, p90 {_f(lb['ttft_p90_s'], '.3f')} s)", "", header,
                  "| --- | --- |" + " ---: |" * 16]
        for run in group:
            for name, p in run["policies"].items():
                reg = p["regime_share"]
                lines.append(
                    f"| ×{run['rate_scale']:g} | {name} | {_f(p['ttft_p50_s'], '.3f')} | {_f(p['ttft_p90_s'], '.3f')} | "
                    f"{_f(p['ttft_p99_s'], '.3f')} | {_f(p['e2e_p50_s'], '.2f')} | {_f(p['e2e_p90_s'], '.2f')} | "
                    f"{_ms(p['itl_p50_s'])} | {_ms(p['itl_p90_s'])} | {_f(p['throughput_rps'], '.2f')} | "
                    f"{_f(p['goodput_rps'], '.2f')} | {_f(p['prefix_hit_ratio'], '.0%')} | "
                    f"{_f(p['host_hit_ratio'], '.0%')} | {_f(p['energy_per_request_j'], ',.0f')} | "
                    f"{_f(reg['compute'], '.0%')} / {_f(reg['transfer'], '.0%')} | "
                    f"{_f(p['ttft_p50_lower_bound_ratio'], '.1f')} | {_f(p['ttft_p90_lower_bound_ratio'], '.1f')} | "
                    f"{_f(p['ttft_mean_lower_bound_ratio'], '.1f')} |")
    return "\n".join(lines) + "\n"


def pd_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """``--pd``'s tables: per workload, each policy's TTFT p90, E2E p90, ITL p50 and split share;
    then whether κ beats every rival on TTFT p90 and E2E p90, and by how much against kappa-aggregated."""
    lines = ["| workload | load | policy | TTFT p90 s | E2E p90 s | ITL p50 ms | split | transfer p50 ms |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        for name, p in run["policies"].items():
            lines.append(f"| {run['workload']} | ×{run['rate_scale']:g} | {name} | {_f(p['ttft_p90_s'], '.3f')} | "
                         f"{_f(p['e2e_p90_s'], '.2f')} | {_ms(p['itl_p50_s'])} | "
                         f"{_f(p.get('disaggregated_share'), '.0%')} | {_ms(p.get('transfer_s_p50'))} |")
    lines += ["", "| workload | κ best TTFT p90 | κ best E2E p90 | κ ÷ kappa-aggregated TTFT p90 / E2E p90 | "
                  "best rival TTFT p90 / E2E p90 |", "| --- | --- | --- | --- | --- |"]
    for run in runs:
        pol, k = run["policies"], run["policies"]["kappa"]
        best = {m: min(PD_RIVALS, key=lambda r: pol[r][m] if pol[r][m] is not None else float("inf"))
                for m in ("ttft_p90_s", "e2e_p90_s")}
        agg = pol["kappa-aggregated"]
        lines.append(f"| {run['workload']} | {'yes' if k['ttft_p90_s'] <= pol[best['ttft_p90_s']]['ttft_p90_s'] else 'no'} | "
                     f"{'yes' if k['e2e_p90_s'] <= pol[best['e2e_p90_s']]['e2e_p90_s'] else 'no'} | "
                     f"{_f(k['ttft_p90_s'] / agg['ttft_p90_s'], '.2f')} / {_f(k['e2e_p90_s'] / agg['e2e_p90_s'], '.2f')} | "
                     f"{best['ttft_p90_s']} / {best['e2e_p90_s']} |")
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Three PNGs: TTFT CDFs at each pair's middle load, p90 TTFT against load, energy per request against load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        pairs.setdefault((run["workload"], run["fleet"]), []).append(run)
    workloads = list(dict.fromkeys(w for w, _ in pairs))
    fleets = list(dict.fromkeys(f for _, f in pairs))
    paths = []

    def grid(title: str):
        fig, axes = plt.subplots(len(workloads), len(fleets), figsize=(5.5 * len(fleets), 3.2 * len(workloads)),
                                 squeeze=False)
        fig.suptitle(title)
        return fig, axes

    fig, axes = grid("TTFT CDF per policy (middle load of each sweep)")
    for (w, f), group in pairs.items():
        ax = axes[workloads.index(w)][fleets.index(f)]
        run = group[len(group) // 2]
        for name, p in run["policies"].items():
            ttfts = sorted(p.get("ttfts_s", ()))
            if ttfts:
                ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
        ax.set_xscale("log")
        ax.set_title(f"{w} / {f} ×{run['rate_scale']:g}", fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "routing_quality_ttft_cdf.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    for key, label, fname in (("ttft_p90_s", "p90 TTFT (s)", "routing_quality_p90_vs_load.png"),
                              ("energy_per_request_j", "energy per request (J)", "routing_quality_energy.png")):
        fig, axes = grid(f"{label} against load")
        for (w, f), group in pairs.items():
            ax = axes[workloads.index(w)][fleets.index(f)]
            for name in POLICIES:
                xs = [run["rate_rps"] or run["rate_scale"] for run in group]
                ys = [run["policies"][name][key] for run in group]
                ax.plot(xs, ys, marker="o", label=name)
            if key == "ttft_p90_s":
                ax.set_yscale("log")
            ax.set_title(f"{w} / {f}", fontsize=9)
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few requests per workload, no plots")
    parser.add_argument("--workloads", default=",".join(PLAN), help="comma-separated subset of " + ", ".join(PLAN))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/routing_quality"
                                                                "[_quick].json)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--middle-load", action="store_true", help="each workload at its middle load only")
    parser.add_argument("--pd", action="store_true", help="the P/D fleet with PD_POLICIES, middle loads (issue 26)")
    args = parser.parse_args(argv)
    if args.pd:
        args.middle_load = args.no_plots = True
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in PLAN]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(PLAN)}")
    assert set(POLICIES) <= set(POLICY_NAMES)
    started = time.perf_counter()
    fleets = load_fleets((PD_FLEET,) if args.pd else FLEETS)
    policies = PD_POLICIES if args.pd else RUNS
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            runs += sweep_workload(name, PLAN[name], fleets, quick=args.quick, seed=args.seed, workers=args.workers,
                                   middle_only=args.middle_load, runs=policies)
        except FileNotFoundError as exc:  # a real trace absent on this machine
            skipped[name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    wall_s = time.perf_counter() - started
    command = "python bench/routing_quality.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    doc = {"meta": {"command": command.strip(), "commit": git_commit(), "seed": args.seed,
                    "ttft_slo_s": DEFAULT_TTFT_SLO_S, "policies": list(PD_POLICIES if args.pd else POLICIES),
                    "variants": {k: {"policy": p, "params": v} for k, (p, v) in VARIANTS.items()}, "fleets": list(fleets),
                    "plan": {w: vars(PLAN[w]) for w in names}, "quick": args.quick, "skipped": skipped,
                    "wall_s": round(wall_s, 1),
                    "workloads": {w: WORKLOADS[w].description for w in names}},
           "runs": runs}
    out = args.out or RESULTS / ("routing_quality_pd.json" if args.pd else "routing_quality_quick.json" if args.quick
                                 else "routing_quality_middle.json" if args.middle_load else "routing_quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One run per line: readable diffs without a line per TTFT.
    out.write_text('{"meta": ' + json.dumps(doc["meta"], indent=1) + ',\n "runs": [\n'
                   + ",\n".join(json.dumps(run) for run in runs) + "\n]}\n")
    tables = pd_markdown(runs) if args.pd else markdown(runs)
    print(tables)
    if args.markdown:
        args.markdown.write_text(tables)
    if not (args.quick or args.no_plots or args.middle_load) and runs:
        for path in plot(runs, out.parent):
            print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)
    print(f"wrote {out}; {wall_s:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
