"""Live routing against the peers: the gateway's κ policy, sglang-router and vllm-router in front of
the same mock fleet, on the same trace and arrivals (issue 25).

For each repetition, each target in turn (the order rotated by one per repetition, so no target
always runs first or last on a warming machine) gets a **fresh** mock fleet of
``config/fleet.local.yaml`` (cold caches, its own free ports; `gateway.commands.fleet.mock_fleet`),
the router started in front of it, and the trace replayed through it open-loop at its own rate
(`gateway.commands.replay`: streamed chat completions with usage, at most ``--concurrency`` in
flight, 64 by default as ``kappa-gateway replay``: later arrivals wait client-side, reported as
``queue_wait_p90_s``, and latencies run from the send). The mocks run at
``--time-scale`` (0.4: 2.5× faster than modelled time), so every latency is divided by it and
reads in modelled seconds, as the demo's do.

Targets:

- ``kappa``: ``kappa-gateway serve`` with the config's policy (`gateway.commands.demo.gateway_process`);
- ``sglang-cache``, ``vllm-router``: the peers as `bench/peer_routers.py` installs and starts them
  (sglang-router 0.3.2 and vllm-router 0.1.17, both ``--policy cache_aware``, everything else as shipped);
  ``--targets`` may add ``sglang-rr``. A peer that cannot be installed is skipped with one line.

Per run: TTFT, E2E and ITL (each request's mean gap between content chunks) p50/p90, mean ITL,
errors, the prefix hit ratio the engines reported (``cached_tokens`` / ``prompt_tokens``) and
requests per backend (each mock's ``vllm:request_success_total``, which every router's requests
reach), and each mock's mean step lag (``mock_vllm:step_lag_seconds``: how late, in wall seconds,
its steps ran against its schedule; a machine too busy to keep the mocks on time shows there). The summary is the median of the repetitions per target and figure, with their
min–max spread, and each peer's figure over κ's.

Usage::

    python bench/routing_live.py --json bench/results/routing_live.json      # 400 Mooncake requests × 3
    python bench/routing_live.py --requests 100 --repetitions 1             # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:  # run as a script from anywhere
        sys.path.insert(0, str(path))

import hot_path  # noqa: E402

hot_path.select()  # an entry point: compiled or source, before the project is imported

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import Settings, load_settings  # noqa: E402
from gateway.commands.demo import DEFAULT_CONFIG, DEFAULT_TIME_SCALE, gateway_process, on_free_ports, scrape_metrics  # noqa: E402
from gateway.commands.fleet import POLL_INTERVAL_S, READY_TIMEOUT_S, mock_fleet  # noqa: E402
from gateway.commands.processes import free_port, stop_processes  # noqa: E402
from gateway.commands.replay import RequestResult, replay  # noqa: E402
from peer_routers import PEER_ROUTERS, READINESS_PATH, install_peers, is_ready, venvs_root  # noqa: E402
from sim.report import percentile  # noqa: E402
from sim.runner import scale_rate  # noqa: E402
from sim.real_traces import real_trace_path  # noqa: E402
from sim.traces import TraceRequest, load_trace  # noqa: E402

DEFAULT_TRACE = real_trace_path("mooncake")
DEFAULT_TARGETS = ("kappa", "sglang-cache", "vllm-router")
FIGURES = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s", "itl_mean_s", "itl_p50_s", "itl_p90_s",
           "errors", "prefix_hit_ratio", "queue_wait_p90_s")
DEFAULT_CONCURRENCY = 64  # `kappa-gateway replay`'s default: at most 64 requests in flight


@contextmanager
def peer_process(python: Path, target: str, worker_urls: Sequence[str]) -> Iterator[str]:
    """A peer router (`peer_routers.PEER_ROUTERS`) in front of ``worker_urls``; yields its URL once
    ``/readiness`` reports every worker healthy."""
    port = free_port()
    cmd = PEER_ROUTERS[target].command(python, worker_urls, port, free_port())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(url, len(worker_urls)):
            if proc.poll() is not None:
                raise RuntimeError(f"{target} exited: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} was not ready in {READY_TIMEOUT_S:g} s")
            time.sleep(POLL_INTERVAL_S)
        yield url
    finally:
        stop_processes([proc], timeout_s=15)
        proc.stderr.close()


def _ready(url: str, n_workers: int) -> bool:
    try:
        with urllib.request.urlopen(url + READINESS_PATH, timeout=1.0) as resp:
            return is_ready(resp.status, resp.read(), n_workers)
    except OSError:
        return False


def summarise_run(results: Sequence[RequestResult], per_backend: dict[str, int], time_scale: float) -> dict[str, Any]:
    """One run's figures (modelled seconds; see the module docstring)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s / time_scale for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s / time_scale for r in ok if r.e2e_s is not None]
    itl = [r.itl_s / time_scale for r in ok if r.itl_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90),
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
        "prefix_hit_ratio": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None,
        "queue_wait_p90_s": percentile([r.queue_wait_s / time_scale for r in results], 90),
        "per_backend": per_backend,
    }


def run_once(target: str, settings: Settings, requests: Sequence[TraceRequest], *, time_scale: float,
             pythons: dict[str, Path], concurrency: int) -> dict[str, Any]:
    """One target on a fresh mock fleet; its `summarise_run` figures plus the wall time."""
    settings = on_free_ports(settings)
    started = time.monotonic()
    with mock_fleet(settings, time_scale=time_scale):
        router = (gateway_process(settings) if target == "kappa"
                  else peer_process(pythons[target], target, [b.url for b in settings.backends]))
        with router as url:
            results = asyncio.run(replay(requests, url=url, model=settings.served_models()[0],
                                         speedup=1.0 / time_scale, concurrency=concurrency, progress=False))
        scraped = {b.id: scrape_metrics(b.url) for b in settings.backends}
    per_backend = {b: int(m.get("vllm:request_success_total", 0.0)) for b, m in scraped.items()}
    run = summarise_run(results, per_backend, time_scale)
    # Whether the mocks kept to their schedule (wall seconds late per step, `mock_vllm.driver`):
    # a mock far behind would stretch every latency of the run.
    run["mock_step_lag_mean_s"] = {b: m.get("mock_vllm:step_lag_seconds_sum", 0.0)
                                   / max(m.get("mock_vllm:step_lag_seconds_count", 0.0), 1.0) for b, m in scraped.items()}
    run["wall_s"] = round(time.monotonic() - started, 1)
    return run


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per target and figure: the median over repetitions and its [min, max]; per peer, its median
    over κ's (``vs_kappa``: > 1 means κ is lower, i.e. better, for latencies)."""
    out: dict[str, Any] = {}
    for target, reps in runs.items():
        row: dict[str, Any] = {}
        for fig in FIGURES:
            values = [r[fig] for r in reps if r.get(fig) is not None]
            row[fig] = statistics.median(values) if values else None
            row[fig + "_range"] = [min(values), max(values)] if values else None
        backends = sorted({b for r in reps for b in r["per_backend"]})
        row["per_backend"] = {b: statistics.median(r["per_backend"].get(b, 0) for r in reps) for b in backends}
        out[target] = row
    base = out.get("kappa")
    if base:
        for target, row in out.items():
            if target != "kappa":
                row["vs_kappa"] = {fig: row[fig] / base[fig] for fig in ("ttft_p90_s", "e2e_p90_s", "itl_mean_s")
                                   if row.get(fig) and base.get(fig)}
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The BENCHMARKS table: medians with their spread, modelled seconds."""
    lines = ["| router | TTFT p50 | TTFT p90 | E2E p50 | E2E p90 | ITL mean | ITL p90 | hit ratio | errors | per backend |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for target, row in summary.items():
        def cell(fig: str, scale: float = 1.0, fmt: str = ".2f") -> str:
            if row.get(fig) is None:
                return "–"
            lo, hi = row[fig + "_range"]
            return f"{row[fig] * scale:{fmt}} ({lo * scale:{fmt}}–{hi * scale:{fmt}})"
        counts = " / ".join(f"{b} {n:g}" for b, n in row["per_backend"].items())
        lines.append(f"| {target} | {cell('ttft_p50_s')} | {cell('ttft_p90_s')} | {cell('e2e_p50_s')} | "
                     f"{cell('e2e_p90_s')} | {cell('itl_mean_s', 1000, '.1f')} ms | {cell('itl_p90_s', 1000, '.1f')} ms | "
                     f"{cell('prefix_hit_ratio', 1.0, '.3f')} | {row['errors']:g} | {counts} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a trace file (default: the Mooncake conversation trace)")
    parser.add_argument("--requests", type=int, default=400, help="its first N requests")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="kappa and peers of bench/peer_routers.py")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                        help="most requests in flight; later arrivals wait client-side (queue_wait_p90_s)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times as frequent")
    parser.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    args = parser.parse_args(argv)
    # SIGTERM ends the bench through its context managers, so every process it started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.trace.is_file():
        print(f"routing_live: no trace at {args.trace} (the real traces are not in the repository: README, \"Real traces\")",
              file=sys.stderr)
        return 2
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t != "kappa" and t not in PEER_ROUTERS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: kappa, {', '.join(PEER_ROUTERS)}")
    pythons, skipped = install_peers(targets, venvs_root())
    targets = [t for t in targets if t not in skipped]
    settings = load_settings(args.config, default_catalog(), env={})
    requests = scale_rate(load_trace(args.trace, limit=args.requests), args.rate_scale)
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    order: list[list[str]] = []
    for rep in range(args.repetitions):
        rotated = targets[rep % len(targets):] + targets[:rep % len(targets)]
        order.append(rotated)
        for target in rotated:
            run = run_once(target, settings, requests, time_scale=args.time_scale, pythons=pythons,
                           concurrency=args.concurrency)
            runs[target].append(run)
            print(f"rep {rep + 1} {target:13s} TTFT p90 {run['ttft_p90_s']:.2f} s  E2E p90 {run['e2e_p90_s']:.2f} s  "
                  f"ITL mean {run['itl_mean_s'] * 1000:.1f} ms  errors {run['errors']}  {run['per_backend']}  "
                  f"({run['wall_s']:.0f} s)", flush=True)
    summary = summarise(runs)
    print(markdown(summary))
    if args.json:
        doc = {"command": " ".join(["python", "bench/routing_live.py", *(argv if argv is not None else sys.argv[1:])]),
               "commit": _commit(), "trace": str(args.trace), "requests": args.requests, "time_scale": args.time_scale,
               "concurrency": args.concurrency, "rate_scale": args.rate_scale,
               "skipped": skipped, "order": order, "runs": runs, "summary": summary}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
