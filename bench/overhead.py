"""What the gateway adds over calling the backend directly and over a bare reverse proxy.

One run, all on 127.0.0.1, side by side, every server its own process:

- ``direct``: the upstream stub (`bench/upstream_stub.py`: OpenAI-shaped, answers at once,
  one process listening on 8 ports);
- ``bare``: `bench/bare_proxy.py`, uvicorn + Starlette + aiohttp, no routing;
- ``memory``: ``kappa-gateway serve`` with the in-memory prefix index, the 8 stub ports as
  its 8 backends;
- ``redis``: the same with the Redis index (a ``redis-server`` started here);
- ``redis@NAME``: with ``--compare NAME=DIR``, the Redis gateway run from another source
  tree, to measure a candidate change against ``redis`` side by side;
- ``redis-pure``, ``memory-pure`` (only when named in ``--targets``): those gateways with
  ``KAPPA_PURE_PYTHON=1``, the hot path run from its Python sources instead of its compiled
  build (`hot_path`), to measure what compiling bought side by side;
- ``bare-w2``, ``redis-w2`` (only when named in ``--targets``): the bare proxy with 2 worker
  processes, and ``kappa-gateway serve --workers 2`` on the Redis index;
- ``relay`` (only when named in ``--targets``): `bench/relay_only.py`, the memory-index
  gateway with its routing work memoised per distinct body — the relay and observability
  alone, the ceiling any routing code can reach on this stack;
- ``sglang-cache``, ``sglang-rr``, ``vllm-router``: the peers, sglang-router with
  its ``cache_aware`` and ``round_robin`` policies and vllm-router with ``cache_aware``, in
  front of the same 8 stub ports, each from PyPI in its own cached venv
  (`bench/peer_routers.py`); a peer whose package cannot be installed is skipped with one
  line on stderr.

Load comes from `bench/loadgen.py` in its own process (or, with ``--loadgen wrk``, from
``wrk``: `bench/loadgen_wrk.py`, the same load for less of the load generator's CPU): closed loop at concurrency 1 and
32, chat bodies of 1k, 8k and 128k tokens (~4 bytes/token of text), 16 distinct prompts
per size in 4 groups that share a system prompt of half the length, cycled, so the index
matches and records real chains. Cells run target after target, in rotated order per
round; p50/p99 are over the pooled rounds, throughput is the median round's (and for ``-w2`` against one process,
also the median of the rounds' own ratios, ``throughput_ratio_vs_one_worker_paired``: both sides
of a round ran within a minute, so a slow phase of the shared machine tends to hit both). "Added"
latency is the difference of percentiles against ``direct`` and against ``bare``.
"Server CPU ms/req" is the CPU time the process under load (stub, proxy, gateway or peer
router, with its threads and child processes) used during the cell, per request (/proc, warm-up included): on a shared 2-core machine it is
steadier than throughput, and it is what an optimisation changes. Beside it, each row has the
CPU per request of the processes that serve every target (``helper_cpu_ms_per_request``: the
``redis-server``, the stub upstream, and the load generator, from ``getrusage(RUSAGE_CHILDREN)``
around its run), so that the machine's CPU per request and the ceiling it sets are in the
output: ``cpu_ceiling_rps`` = usable cores / all of it, ``process_ceiling_rps`` = the target's
processes (2 for ``-w2``, else 1; none for the peers, whose threads we do not count) / its own
(`overhead_report.cpu_arithmetic`; the notes under the side-by-side table). The idle
targets' own timers (health checks, scrapes, the peers' periodic exchange) are not counted.
The routing decision
time is the p50 of the gateway's own ``gateway_routing_decision_seconds`` histogram
(interpolated in its buckets). Tables and the budget verdict: `bench/overhead_report.py`; the
servers and their start-up: `bench/overhead_servers.py`.

    python bench/overhead.py [--quick] [--json] [--rounds N] [--cell-s S] [--sizes 8k,128k]
                             [--targets direct,bare,memory,redis,sglang-cache,sglang-rr,vllm-router]
                             [--compare NAME=DIR ...] [--loadgen python|wrk]

Full run: 3 rounds of 3 s per cell, JSON and SSE bodies at every size.
``--quick``: 2 rounds of 1.5 s, SSE bodies only at 8k. ``--json`` prints the
results as JSON on stdout (the table goes to stderr). A ``--compare`` tree is started with
``python -m gateway`` from that directory, so its code is the one imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hot_path

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from overhead_report import (  # noqa: E402
    HEADERS,
    bucket_p50_ms,
    cpu_arithmetic,
    derive,
    machine,
    pct,
    row_line,
    side_by_side_table,
    source_commit,
    summary,
)
import loadgen_wrk
from overhead_servers import BENCH_DIR, MODEL, http_get, servers
from peer_routers import PEER_ROUTERS, install_peers, venvs_root
from prometheus_client.parser import text_string_to_metric_families

from prefix_index import BYTES_PER_TOKEN_ESTIMATE

SIZES_TOKENS = {"1k": 1_024, "8k": 8_192, "128k": 131_072}
PROMPTS_PER_SIZE, PROMPT_GROUPS, SHARED_PREFIX_RATIO = 16, 4, 0.5
MAX_TOKENS = 16
CHAT_PATH = "/v1/chat/completions"
# Each cell measures for CELL_S seconds or MAX_REQUESTS requests, whichever ends first,
# after a warm-up of max(16 prompts, 2 x concurrency) requests.
CELL_S, QUICK_CELL_S = 3.0, 1.5
MAX_REQUESTS = 50_000
DEFAULT_TARGETS = ("direct", "bare", "memory", "redis", *PEER_ROUTERS)


def make_bodies(size: str, stream: bool) -> list[bytes]:
    """16 chat bodies of ~size tokens: 4 groups share a system prompt of half the length."""
    rnd = random.Random(f"overhead-{size}")  # same prompts in every run and for every target
    vocab = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 7))) for _ in range(4096)]

    def text(n_bytes: int) -> str:
        return " ".join(rnd.choices(vocab, k=max(n_bytes * 2 // 11, 1)))  # 4.5 letters + a space a word

    n_bytes = int(SIZES_TOKENS[size] * BYTES_PER_TOKEN_ESTIMATE)
    shared = [text(int(n_bytes * SHARED_PREFIX_RATIO)) for _ in range(PROMPT_GROUPS)]
    bodies = []
    for i in range(PROMPTS_PER_SIZE):
        body: dict[str, Any] = {"stream": stream, "model": MODEL, "max_tokens": MAX_TOKENS, "messages": [
            {"role": "system", "content": shared[i % PROMPT_GROUPS]},
            {"role": "user", "content": text(int(n_bytes * (1 - SHARED_PREFIX_RATIO)))}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(json.dumps(body, separators=(",", ":")).encode())
    return bodies


def is_gateway(target: str) -> bool:
    """Whether a target is a kappa-gateway (it has the gateway's /metrics on its port)."""
    return not target.startswith(("direct", "bare")) and target not in PEER_ROUTERS


def histograms(port: int) -> dict[str, dict[Any, float]]:
    """Cumulative bucket counts (summed over labels) of the gateway's timing histograms, and
    ``index_errors`` by op."""
    _, text = http_get(port, "/metrics")
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == "gateway_index_errors_total":  # failed or timed-out index calls, by op
                out.setdefault("index_errors", {})[s.labels["op"]] = s.value
                continue
            if s.name == "gateway_routing_decision_seconds_bucket":
                key = "decision"
            elif s.name == "gateway_index_seconds_bucket":
                key = "index_" + s.labels["op"]
            else:
                continue
            le = float(s.labels["le"])
            out.setdefault(key, {})[le] = out.get(key, {}).get(le, 0.0) + s.value
    return out


def run_load(port: int, bodies_file: Path, concurrency: int, cell_s: float, loadgen: str = "python") -> dict:
    if loadgen == "wrk":
        return loadgen_wrk.run(port, CHAT_PATH, bodies_file, concurrency, cell_s)
    out_file = bodies_file.with_suffix(".result.json")
    spec = {"port": port, "path": CHAT_PATH, "bodies_file": str(bodies_file), "concurrency": concurrency,
            "requests": MAX_REQUESTS, "warmup": max(PROMPTS_PER_SIZE, 2 * concurrency), "max_s": cell_s,
            "out_file": str(out_file)}
    done = subprocess.run([sys.executable, str(BENCH_DIR / "loadgen.py"), json.dumps(spec)],
                          capture_output=True, timeout=3 * cell_s + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(out_file.read_text(encoding="utf-8"))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process and its live descendants have used (Linux /proc):
    a ``--workers`` target's CPU is its workers'."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    total += cpu_s(int(child))
    return total


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have ended and been waited for
    (during a cell: its load generator, the only child that ends then)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(args: argparse.Namespace, targets: dict[str, tuple[int, int]], helpers: dict[str, int],
            workdir: Path) -> list[dict]:
    """Every cell, target after target; returns one row per (cell, target). ``helpers``: name ->
    pid of the processes every target uses, whose CPU per request each row also records."""
    rows = []
    for size in args.sizes:
        for stream in args.streams if size == "8k" or not args.quick else [False]:  # --quick: streams at 8k
            bodies_file = workdir / f"bodies-{size}-{stream}.txt"
            bodies_file.write_bytes(b"\n".join(make_bodies(size, stream)))
            for concurrency in args.concurrency:
                names = list(targets)
                runs: dict[str, list[dict]] = {t: [] for t in names}
                cpu_ms: dict[str, list[float]] = {t: [] for t in names}
                helper_ms: dict[str, list[dict[str, float]]] = {t: [] for t in names}
                decision: dict[str, list[float]] = {t: [] for t in names}
                for r in range(args.rounds):
                    for t in names[r % len(names):] + names[: r % len(names)]:
                        port, pid = targets[t]
                        before = histograms(port) if is_gateway(t) else None
                        # the stub is itself the target "direct": counted once, as the target
                        helpers_before = {h: cpu_s(p) for h, p in helpers.items() if p != pid}
                        loadgen_before = children_cpu_s()
                        cpu_before = cpu_s(pid)
                        run = run_load(port, bodies_file, concurrency, args.cell_s, args.loadgen)
                        n = run["completed"] + run["warmup"]
                        cpu_ms[t].append((cpu_s(pid) - cpu_before) * 1e3 / n)
                        used = {h: (cpu_s(helpers[h]) - before) * 1e3 / n for h, before in helpers_before.items()}
                        helper_ms[t].append({**used, "loadgen": (children_cpu_s() - loadgen_before) * 1e3 / n})
                        runs[t].append(run)
                        if before is not None:
                            p50 = bucket_p50_ms(histograms(port).get("decision", {}), before.get("decision"))
                            if p50 is not None:
                                decision[t].append(p50)
                for t in names:
                    lat = [x * 1e3 for run in runs[t] for x in run["latencies_s"]]
                    rows.append({"size": size, "stream": stream, "concurrency": concurrency, "target": t,
                                 "requests": len(lat), "errors": sum(run["errors"] for run in runs[t]),
                                 "p50_ms": statistics.median(lat), "p99_ms": pct(lat, 0.99),
                                 "rps": statistics.median(run["completed"] / run["elapsed_s"] for run in runs[t]),
                                 "rps_by_round": [run["completed"] / run["elapsed_s"] for run in runs[t]],
                                 "cpu_ms_per_request": statistics.median(cpu_ms[t]),
                                 "helper_cpu_ms_per_request": {h: statistics.median(r[h] for r in helper_ms[t])
                                                               for h in helper_ms[t][0]},
                                 "decision_p50_ms": statistics.median(decision[t]) if decision[t] else None})
                derive(rows[-len(names):])
                for row in rows[-len(names):]:
                    cpu_arithmetic(row, args.cores)
                for row in rows[-len(names):]:
                    print(row_line(row), file=sys.stderr, flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced set, under 3 minutes")
    p.add_argument("--json", action="store_true", help="print JSON on stdout (the table goes to stderr)")
    p.add_argument("--rounds", type=int, help="rounds per cell (default 3; --quick 2)")
    p.add_argument("--cell-s", type=float, help=f"seconds per measurement (default {CELL_S}; --quick {QUICK_CELL_S})")
    p.add_argument("--sizes", help="comma list of 1k,8k,128k")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma list of the targets to load (add relay for the routing-free ceiling, "
                        "bare-w2,redis-w2 for two workers; peers that cannot be installed are skipped)")
    p.add_argument("--loadgen", choices=("python", "wrk"), default="python",
                   help="the load generator: bench/loadgen.py, or wrk (C; bench/loadgen_wrk.py), which takes "
                        "~0.65x its CPU per request from the cores the servers share")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                   help="also load a Redis gateway run from source tree DIR, as target redis@NAME")
    args = p.parse_args(argv)
    if args.loadgen == "wrk" and not loadgen_wrk.available():
        p.error("--loadgen wrk: wrk is not installed (apt-get install wrk)")
    args.compare = [tuple(c.split("=", 1)) for c in args.compare]
    args.targets = args.targets.split(",")
    args.sizes = args.sizes.split(",") if args.sizes else list(SIZES_TOKENS)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.cell_s = args.cell_s or (QUICK_CELL_S if args.quick else CELL_S)
    args.streams = [False, True]
    args.concurrency = [1, 32]
    args.peer_pythons, args.peers_skipped, args.peer_commands = {}, {}, {}
    args.cores = len(os.sched_getaffinity(0))  # the cores this run's processes may use
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    report: dict[str, Any] = {"command": shlex.join(sys.orig_argv), "commit": source_commit(), "machine": machine(),
                              "loadgen": args.loadgen,
                              # the build the gateways of this tree run (the -pure targets: their sources)
                              "hot_path": hot_path.describe()}
    print(f"$ {report['command']}  # at {report['commit']}\n{json.dumps(report['machine'])}", file=sys.stderr)
    args.peer_pythons, args.peers_skipped = install_peers(args.targets, venvs_root())
    args.targets = [t for t in args.targets if t not in args.peers_skipped]
    print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="kappa-overhead-") as tmp, servers(args, Path(tmp)) as (targets, helpers):
        rows = measure(args, targets, helpers, Path(tmp))
        final = {t: histograms(port) for t, (port, _) in targets.items() if is_gateway(t)}
    report["peers"] = {t: {"package": PEER_ROUTERS[t].package, "version": PEER_ROUTERS[t].version,
                           "policy": PEER_ROUTERS[t].policy, "command": cmd} for t, cmd in args.peer_commands.items()}
    report["peers_skipped"] = args.peers_skipped
    report.update(summary(rows, final), rows=rows, duration_s=round(time.monotonic() - started, 1))
    print(side_by_side_table(report), file=sys.stderr)
    print(json.dumps({k: v for k, v in report.items() if k not in ("rows", "machine", "command")}, indent=2),
          file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
