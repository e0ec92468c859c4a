"""Gateway replicas live: two ``serve`` processes on one Redis against one, on the mock fleet.

The demo fleet (`config/fleet.local.yaml`: four mock vLLM backends sharing a KV pool, run by
`gateway.commands.fleet.mock_fleet` at ``--time-scale``) behind, in turn:

- ``one``: one gateway on a Redis index;
- ``two-synced``: two gateways on that Redis exchanging their load (`gateway.replicas.peer_load`, the default);
- ``two-local``: two gateways sharing only the index (``index.share_load: false``);

each replaying the first ``--requests`` requests of the Mooncake conversation trace at its
own pace, spread round-robin over the gateways as a load balancer would (`replay` with two
URLs). Every variant gets a fresh mock fleet (empty caches) and its own Redis keys. Rounds
rotate the variants' order. Prints TTFT p50/p90 per variant, pooled over rounds, and each
two-gateway p90 against one gateway's::

    python bench/replicas_live.py --requests 400 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis as redis_py

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # this script is an entry point: compiled or source, before the project is imported

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import Settings, load_settings, parse_settings  # noqa: E402
from gateway.commands.demo import gateway_process, on_free_ports  # noqa: E402
from gateway.commands.fleet import mock_fleet  # noqa: E402
from gateway.commands.processes import free_port, stop_processes  # noqa: E402
from gateway.commands.replay import replay  # noqa: E402
from sim.real_traces import missing_message, real_trace_path  # noqa: E402
from sim.traces import load_trace  # noqa: E402

MOONCAKE = real_trace_path("mooncake")
VARIANTS = ("one", "two-synced", "two-local")


def with_redis(settings: Settings, redis_url: str, key_prefix: str, *, share_load: bool, port: int) -> Settings:
    doc = settings.model_dump(mode="json")
    doc["index"].update(backend="redis", redis_url=redis_url, key_prefix=key_prefix, share_load=share_load)
    doc["gateway"]["port"] = port
    return parse_settings(doc, default_catalog(), env={})


def wait_for_redis(url: str, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with redis_py.Redis.from_url(url) as client:
        while True:
            try:
                client.ping()
                return
            except redis_py.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # poll interval


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def run_variant(name: str, base: Settings, redis_url: str, requests: list, time_scale: float, round_no: int) -> dict:
    n = 1 if name == "one" else 2
    gateways = [with_redis(base, redis_url, f"live-{name}-{round_no}", share_load=name != "two-local",
                           port=free_port()) for _ in range(n)]
    with mock_fleet(base, time_scale=time_scale), contextlib.ExitStack() as stack:
        urls = [stack.enter_context(gateway_process(g)) for g in gateways]
        started = time.monotonic()
        results = asyncio.run(replay(requests, url=urls, model=base.served_models()[0], speedup=1.0 / time_scale,
                                     concurrency=512, progress=False))
        wall_s = time.monotonic() - started
    ttfts = [r.ttft_s / time_scale for r in results if r.ok and r.ttft_s is not None]  # modelled seconds
    return {"variant": name, "round": round_no, "ok": len(ttfts), "errors": sum(not r.ok for r in results),
            "ttft_s": ttfts, "wall_s": round(wall_s, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=0.4, help="mocks' wall seconds per modelled second")
    parser.add_argument("--config", type=Path, default=REPO / "config" / "fleet.local.yaml")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not MOONCAKE.exists():
        print(missing_message("mooncake"), file=sys.stderr)
        return 2
    requests = load_trace(MOONCAKE, limit=args.requests)
    base = on_free_ports(load_settings(args.config, default_catalog(), env={}))
    redis_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        redis = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind",
                                  "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
                                 stdout=subprocess.DEVNULL)
        try:
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            wait_for_redis(redis_url, redis)
            runs = []
            for r in range(args.rounds):
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
                for name in order:
                    run = run_variant(name, base, redis_url, requests, args.time_scale, r)
                    runs.append(run)
                    print(f"round {r} {name}: {run['ok']} ok, {run['errors']} errors, TTFT p90 "
                          f"{pct(run['ttft_s'], 0.9):.2f} s (modelled), {run['wall_s']} s wall", file=sys.stderr)
        finally:
            stop_processes([redis])
    summary: dict[str, Any] = {}
    for name in VARIANTS:
        pooled = [x for run in runs if run["variant"] == name for x in run["ttft_s"]]
        summary[name] = {"requests_ok": len(pooled), "errors": sum(run["errors"] for run in runs
                                                                     if run["variant"] == name),
                         "ttft_p50_s": statistics.median(pooled), "ttft_p90_s": pct(pooled, 0.9),
                         "ttft_p90_by_round_s": [round(pct(run["ttft_s"], 0.9), 3) for run in runs
                                                 if run["variant"] == name]}
    for name in ("two-synced", "two-local"):
        summary[name]["ttft_p90_vs_one"] = summary[name]["ttft_p90_s"] / summary["one"]["ttft_p90_s"]
    out = {"command": " ".join(["python", "bench/replicas_live.py", *sys.argv[1:]]), "requests": args.requests,
           "rounds": args.rounds, "time_scale": args.time_scale, "summary": summary}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, row in summary.items():
            print(f"{name:11} TTFT p50 {row['ttft_p50_s']:.2f} s  p90 {row['ttft_p90_s']:.2f} s"
                  + (f"  ({row['ttft_p90_vs_one']:.2f}× one gateway)" if "ttft_p90_vs_one" in row else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
