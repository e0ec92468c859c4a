"""The gateway's per-request routing work, in process: what compiled code buys (issue 14).

The same `gateway.routing.RoutingService` the live gateway builds (8 backends, the in-memory
prefix index, policy ``kappa``), fed the bodies `bench/overhead.py` sends (16 chat bodies of
~8k or ~128k tokens, 4 groups sharing a system prompt of half the length), one after the
other, as the proxy does per request:

- ``parse``: JSON parse, validation, canonical prompt bytes, chained block hashes;
- ``plan``: capacities, index match over the 8 backends, in-flight overlay, candidates and
  the cost model for each backend, the policy's ranking;
- ``book``: charge the chosen backend's ledger, record the chain in the index, finish the
  ticket of the request routed ``--in-flight`` requests earlier (default 31: the gateway at
  concurrency 32 has that many in flight, in its ledgers and in-flight overlay).

Prints, per stage, the median µs per request and which modules ran compiled (mypyc,
`setup.py`, `hot_path`) — run it once with ``KAPPA_PURE_PYTHON=1`` and once without to compare
side by side, or pass ``--both`` to do it in two child processes of one run:

    python bench/hot_path_bench.py [--size 8k|128k] [--requests N] [--both] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


def settings_doc(n_backends: int = 8) -> dict[str, Any]:
    from overhead_servers import HARDWARE, MODEL  # bench/ is on sys.path when run as a script
    return {"gateway": {"host": "127.0.0.1", "port": 1},
            "index": {"backend": "memory"}, "routing": {"policy": "kappa", "seed": 0},
            "backends": [{"id": f"b{i}", "url": f"http://127.0.0.1:{10_000 + i}", "model": MODEL,
                          "hardware": HARDWARE} for i in range(n_backends)]}


async def measure(size: str, requests: int, in_flight: int = 0) -> dict[str, Any]:
    import aiohttp
    from prometheus_client import CollectorRegistry

    import hot_path

    hot_path.select()  # the script's entry: compiled or source (KAPPA_PURE_PYTHON), before the imports below
    from fleet_config.catalog import default_catalog
    from fleet_config.settings import parse_settings
    from gateway.backends.backend_set import BackendSet
    from gateway.backends.backend_state import BackendState
    from gateway.routing import RoutingService
    from gateway.telemetry.metrics import Telemetry
    from overhead import make_bodies
    from dispatch import Ticket
    from prefix_index import MemoryPrefixIndex
    from router.calibration import BytesPerToken
    from router.policies import build_policy

    catalog = default_catalog()
    settings = parse_settings(settings_doc(), catalog, env={})
    telemetry = Telemetry(CollectorRegistry())
    states = [BackendState.of(b, settings.backend_spec(catalog, b), healthy=True) for b in settings.backends]
    bodies = make_bodies(size, False)

    async def no_restart(backend_id: str) -> None:
        return None

    timings: dict[str, list[float]] = {"parse": [], "plan": [], "book": []}
    clock = time.perf_counter
    async with aiohttp.ClientSession() as session:
        backends = BackendSet(states, session, telemetry, on_restart=no_restart, health_interval_s=1,
                              scrape_interval_s=1)
        routing = RoutingService(settings, backends, MemoryPrefixIndex(), build_policy("kappa", {}), telemetry,
                                 BytesPerToken(default=settings.index.bytes_per_token), random.Random(0))
        by_id = {s.id: s for s in states}
        open_tickets: deque[Ticket] = deque()
        for i in range(requests + len(bodies)):  # the first pass over the bodies warms the index
            t0 = clock()
            parsed = routing.parse("chat", bodies[i % len(bodies)])
            t1 = clock()
            plan = await routing.plan(parsed)
            t2 = clock()
            chosen = plan.decision.chosen
            ticket = routing.charge(plan, chosen)
            await routing.record(parsed.model, by_id[chosen.backend_id], list(parsed.hashes))
            open_tickets.append(ticket)
            while len(open_tickets) > in_flight:  # the gateway at concurrency in_flight + 1
                open_tickets.popleft().finish()
            t3 = clock()
            if i >= len(bodies):
                timings["parse"].append(t1 - t0)
                timings["plan"].append(t2 - t1)
                timings["book"].append(t3 - t2)
    stages = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
    return {"size": size, "requests": requests, "in_flight": in_flight, "hot_path": hot_path.describe(),
            "compiled_modules": hot_path.compiled_modules(),
            "us_per_request": {**{k: round(v, 1) for k, v in stages.items()},
                               "total": round(sum(stages.values()), 1)}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="8k", choices=["1k", "8k", "128k"])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--in-flight", type=int, default=31,
                   help="requests kept in flight (their tickets open) while the next is routed, as at concurrency N+1")
    p.add_argument("--both", action="store_true", help="run pure Python and compiled, side by side")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.both:
        result = asyncio.run(measure(args.size, args.requests, args.in_flight))
        print(json.dumps(result) if args.json else result)
        return
    runs: dict[str, list[dict[str, Any]]] = {"pure": [], "compiled": []}
    for _ in range(3):  # interleaved rounds: this machine is shared
        for name in runs:
            env = {**os.environ, "KAPPA_PURE_PYTHON": "1" if name == "pure" else ""}
            out = subprocess.run([sys.executable, __file__, "--size", args.size, "--requests", str(args.requests),
                                  "--in-flight", str(args.in_flight), "--json"], env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout))
    summary: dict[str, Any] = {"size": args.size, "requests": args.requests, "in_flight": args.in_flight, "rounds": 3}
    for name, results in runs.items():
        summary[name] = {"compiled_modules": results[0]["compiled_modules"],
                         "us_per_request": {k: statistics.median(r["us_per_request"][k] for r in results)
                                            for k in results[0]["us_per_request"]}}
    summary["speedup"] = {k: round(summary["pure"]["us_per_request"][k] / summary["compiled"]["us_per_request"][k], 2)
                          for k in summary["pure"]["us_per_request"]}
    print(json.dumps(summary, indent=None if args.json else 2))


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR))
    main()
