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

``--pd`` (issue 26, "Peers, live"): the P/D fleet ``config/fleet.pd.local.yaml`` (two B200
prefill, a GH200 ``both``, two H100 decode mocks speaking vLLM's NixlConnector protocol) and the
targets ``kappa`` (κ with P/D, the config's policy), optionally ``kappa-aggregated`` (κ never
splitting), and ``vllm-router-pd``: vllm-router 0.1.17 ``--vllm-pd-disaggregation`` (its default
``--kv-connector nixl``: the toy proxy's two phases, which the mocks answer as vLLM does), the
prefill-role mocks as ``--prefill``, the decode-role ones as ``--decode``, the ``both`` mock as
``--both-as`` (decode by default: the peers have no "both" role). ``sglang-router-pd`` can be
added, but its P/D mode speaks SGLang's bootstrap protocol, which vLLM engines ignore: each request
is then served whole by a prefill and a decode mock at once (`bench/pd_capture.py` shows it;
BENCHMARKS.md, "P/D peers, live"). A P/D run also reports, from the mocks, the KV pulls (split
requests whose decode pulled blocks), their bytes and failures, and the prompt tokens the fleet
computed (the client's ``cached_tokens`` is not comparable: vllm-router replaces the decode's
figure by the prefill's).

Usage::

    python bench/routing_live.py --json bench/results/routing_live.json      # 400 Mooncake requests × 3
    python bench/routing_live.py --pd --requests 200 --targets kappa,kappa-aggregated,vllm-router-pd
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
from peer_routers import PD_PEER_ROUTERS, PEER_ROUTERS, READINESS_PATH, PdPeerRouter, install_peers, is_pd_ready, is_ready, venvs_root  # noqa: E402
from sim.report import percentile  # noqa: E402
from sim.runner import scale_rate  # noqa: E402
from sim.real_traces import real_trace_path  # noqa: E402
from sim.traces import TraceRequest, load_trace  # noqa: E402

DEFAULT_TRACE = real_trace_path("mooncake")
DEFAULT_TARGETS = ("kappa", "sglang-cache", "vllm-router")
PD_CONFIG = REPO / "config" / "fleet.pd.local.yaml"
PD_TARGETS = ("kappa", "vllm-router-pd")  # sglang-router-pd may be added: it is not P/D on vLLM engines
KAPPA_POLICIES = {"kappa": None, "kappa-aggregated": "kappa-aggregated"}  # target -> policy override (None: the config's)
FIGURES = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s", "itl_mean_s", "itl_p50_s", "itl_p90_s",
           "errors", "prefix_hit_ratio", "queue_wait_p90_s")
PD_FIGURES = ("kv_pulls", "kv_failed_transfers", "kv_transfer_bytes", "computed_prompt_tokens")  # P/D runs only (`pd_figures`)
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


def pd_roles(settings: Settings, both_as: str = "decode") -> tuple[list[str], list[str]]:
    """(prefill URLs, decode URLs) for a peer's P/D mode: each backend by its ``kv_role``; a
    ``both`` one (which the peers cannot express) as ``both_as``: ``prefill``, ``decode`` or
    ``none`` (left out)."""
    prefill = [b.url for b in settings.backends if b.kv_role == "prefill" or (b.kv_role == "both" and both_as == "prefill")]
    decode = [b.url for b in settings.backends if b.kv_role == "decode" or (b.kv_role == "both" and both_as == "decode")]
    return prefill, decode


@contextmanager
def pd_peer_process(peer: PdPeerRouter, python: Path, prefill: Sequence[str], decode: Sequence[str], *,
                    log_path: Path | None = None) -> Iterator[str]:
    """A peer in its P/D mode (`peer_routers.PD_PEER_ROUTERS`); yields its URL once ``/readiness``
    reports every worker healthy. Its output goes to ``log_path`` (discarded without one)."""
    port = free_port()
    cmd = peer.command(python, prefill, decode, port, free_port())
    log = log_path.open("wb") if log_path else None
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=log or subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _pd_ready(url, len(prefill), len(decode)):
            if proc.poll() is not None:
                raise RuntimeError(f"{peer.target} exited {proc.returncode}: {' '.join(cmd)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{peer.target} was not ready in {READY_TIMEOUT_S:g} s")
            time.sleep(POLL_INTERVAL_S)
        yield url
    finally:
        stop_processes([proc], timeout_s=15)
        if log:
            log.close()


def _pd_ready(url: str, n_prefill: int, n_decode: int) -> bool:
    try:
        with urllib.request.urlopen(url + READINESS_PATH, timeout=1.0) as resp:
            return is_pd_ready(resp.status, resp.read(), n_prefill, n_decode)
    except OSError:
        return False


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
             pythons: dict[str, Path], concurrency: int, both_as: str = "decode") -> dict[str, Any]:
    """One target on a fresh mock fleet; its `summarise_run` figures plus the wall time."""
    settings = on_free_ports(settings, policy=KAPPA_POLICIES.get(target))
    started = time.monotonic()
    with mock_fleet(settings, time_scale=time_scale):
        if target in KAPPA_POLICIES:
            router = gateway_process(settings)
        elif target in PD_PEER_ROUTERS:
            router = pd_peer_process(PD_PEER_ROUTERS[target], pythons[target], *pd_roles(settings, both_as))
        else:
            router = peer_process(pythons[target], target, [b.url for b in settings.backends])
        with router as url:
            results = asyncio.run(replay(requests, url=url, model=settings.served_models()[0],
                                         speedup=1.0 / time_scale, concurrency=concurrency, progress=False))
        scraped = {b.id: scrape_metrics(b.url) for b in settings.backends}
    per_backend = {b: int(m.get("vllm:request_success_total", 0.0)) for b, m in scraped.items()}
    run = summarise_run(results, per_backend, time_scale)
    if settings.disaggregated:
        run.update(pd_figures(settings, scraped))
    # Whether the mocks kept to their schedule (wall seconds late per step, `mock_vllm.driver`):
    # a mock far behind would stretch every latency of the run.
    run["mock_step_lag_mean_s"] = {b: m.get("mock_vllm:step_lag_seconds_sum", 0.0)
                                   / max(m.get("mock_vllm:step_lag_seconds_count", 0.0), 1.0) for b, m in scraped.items()}
    run["wall_s"] = round(time.monotonic() - started, 1)
    return run


def pd_figures(settings: Settings, scraped: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the P/D mocks saw: KV pulls (the decode side's NIXL transfers: the histogram has one
    observation per TP rank of the reader, so its count over the TP is the number of pulls, i.e.
    of split requests whose decode lacked some blocks), their bytes, and failed pulls."""
    tp = {b.id: b.tensor_parallel for b in settings.backends}
    pulls = {b: m.get("vllm:nixl_xfer_time_seconds_count", 0.0) / max(tp[b], 1) for b, m in scraped.items()}
    return {
        "kv_pulls": int(round(sum(pulls.values()))),
        "kv_pulls_per_backend": {b: int(round(n)) for b, n in pulls.items() if n},
        "kv_failed_transfers": int(sum(m.get("vllm:nixl_num_failed_transfers_total", 0.0) for m in scraped.values())),
        "kv_transfer_bytes": sum(m.get("vllm:nixl_bytes_transferred_sum", 0.0) for m in scraped.values()),
        # Prompt tokens the fleet computed (every prefill, phase or whole): the engines' own count, the
        # same for every router (the client's cached_tokens is not: vllm-router reports the prefill's).
        "computed_prompt_tokens": int(sum(m.get('vllm:prompt_tokens_by_source_total{source="local_compute"}', 0.0)
                                          for m in scraped.values())),
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per target and figure: the median over repetitions and its [min, max]; per peer, its median
    over κ's (``vs_kappa``: > 1 means κ is lower, i.e. better, for latencies)."""
    out: dict[str, Any] = {}
    for target, reps in runs.items():
        row: dict[str, Any] = {}
        pd_figs = PD_FIGURES if any("kv_pulls" in r for r in reps) else ()
        for fig in (*FIGURES, *pd_figs):
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
        if row.get("kv_pulls") is not None:  # a P/D run: the split requests whose decode pulled KV
            counts = (f"KV pulls {cell('kv_pulls', 1.0, '.0f')}; prompt tokens computed "
                      f"{cell('computed_prompt_tokens', 1e-6, '.2f')} M; {counts}")
        lines.append(f"| {target} | {cell('ttft_p50_s')} | {cell('ttft_p90_s')} | {cell('e2e_p50_s')} | "
                     f"{cell('e2e_p90_s')} | {cell('itl_mean_s', 1000, '.1f')} ms | {cell('itl_p90_s', 1000, '.1f')} ms | "
                     f"{cell('prefix_hit_ratio', 1.0, '.3f')} | {row['errors']:g} | {counts} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a trace file (default: the Mooncake conversation trace)")
    parser.add_argument("--requests", type=int, default=400, help="its first N requests")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--pd", action="store_true",
                        help=f"P/D: the P/D fleet ({PD_CONFIG.relative_to(REPO)}), κ (P/D) against the peers' P/D modes")
    parser.add_argument("--targets", default=None,
                        help=f"kappa, kappa-aggregated and peers of bench/peer_routers.py (default: {','.join(DEFAULT_TARGETS)}; "
                             f"with --pd: {','.join(PD_TARGETS)})")
    parser.add_argument("--config", type=Path, default=None, help="default: config/fleet.local.yaml; with --pd: the P/D fleet")
    parser.add_argument("--both-as", choices=("decode", "prefill", "none"), default="decode",
                        help="--pd: how a kv_role: both backend is given to a peer, which has no such role")
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
    args.config = args.config or (PD_CONFIG if args.pd else DEFAULT_CONFIG)
    targets = [t for t in (args.targets or ",".join(PD_TARGETS if args.pd else DEFAULT_TARGETS)).split(",") if t]
    known = [*KAPPA_POLICIES, *(PD_PEER_ROUTERS if args.pd else PEER_ROUTERS)]
    unknown = [t for t in targets if t not in known]
    if unknown:
        parser.error(f"unknown targets {unknown}; known{' with --pd' if args.pd else ''}: {', '.join(known)}")
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
                           concurrency=args.concurrency, both_as=args.both_as)
            runs[target].append(run)
            pulls = f"  KV pulls {run['kv_pulls']}" if "kv_pulls" in run else ""
            print(f"rep {rep + 1} {target:16s} TTFT p90 {run['ttft_p90_s']:.2f} s  E2E p90 {run['e2e_p90_s']:.2f} s  "
                  f"ITL mean {run['itl_mean_s'] * 1000:.1f} ms  errors {run['errors']}{pulls}  {run['per_backend']}  "
                  f"({run['wall_s']:.0f} s)", flush=True)
    summary = summarise(runs)
    print(markdown(summary))
    if args.json:
        doc = {"command": " ".join(["python", "bench/routing_live.py", *(argv if argv is not None else sys.argv[1:])]),
               "commit": _commit(), "trace": str(args.trace), "requests": args.requests, "time_scale": args.time_scale,
               "concurrency": args.concurrency, "rate_scale": args.rate_scale, "config": str(args.config),
               **({"pd": True, "both_as": args.both_as, "peer_commands": {
                   t: " ".join(PD_PEER_ROUTERS[t].command(Path("python"), *pd_roles(settings, args.both_as), 0, 0))
                   for t in targets if t in PD_PEER_ROUTERS}} if args.pd else {}),
               "skipped": skipped, "order": order, "runs": runs, "summary": summary}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
