"""How exact is the gateway's prefix index, event-fed or approximate, on Locust-like traffic (issue 30)?

The workload (`index_accuracy_workload`): tenants' long shared system prompts, unique questions (some
pasting a document), multi-turn follow-ups, open-loop at fixed arrivals, sent as streamed chat
completions through a real ``kappa-gateway serve`` (a child process) in front of the demo fleet's
mocks (``config/fleet.local.yaml``: four mock vLLM engines in one ``mock-fleet`` process sharing a KV
pool, on free ports, KV-event endpoints included: `gateway.commands.demo.on_free_ports`). The host
tiers are cut (``--host-tier-gb``, 16 GB: ~49k tokens of Llama-3.1-70B KV each) so that HBM and host
tier overflow and the engines evict blocks (the pool keeps the config's 1 TB unless ``--kv-pool-gb``
cuts it, or removes it: ``-1``, private host tiers only, where an evicted prefix is gone from its
backend and only the event-fed index knows it); the evictions are counted from the engines' own KV events
(`index_accuracy_probe.EventCounter`).

Two modes, each run on a fresh fleet and gateway, with the same requests and arrivals:

- ``exact``: the config as shipped: the gateway tokenises with ``models.<m>.tokenizer`` and reads
  every backend's ``kv_events`` (the event-fed index, `gateway.backends.kv_events_fleet`);
- ``approximate``: the gateway's config without ``tokenizer`` and ``kv_events`` (the byte-block
  index). The engines are the same in both (``--approximate-engines same``, the default): they
  tokenise with the shipped tokenizer and publish events, as a vLLM engine does whether or not a
  router listens, so the modes differ only in the gateway. ``stripped`` takes them off the mocks too
  (the config file with both lines deleted, as in ``kappa-gateway demo --config``): the mocks then
  count tokens with their own tokenizer and skip the block hashing, and spend less CPU.

``--repetitions`` alternate the modes (E A, A E, E A, ...). Per run and per mode (median, min–max):
the share of requests whose predicted K was within one block of the engine's ``cached_tokens``
(16-token engine block and 64-token index block), MAE, over/under counts, TTFT p50/p90, E2E p90 and
the prefix hit ratio (`index_accuracy_report`), requests routed with their backend in exact mode,
evictions, the CPU the gateway and the mocks spent. Run with ``KAPPA_PURE_PYTHON=1``: the modes are
compared with each other on one machine, not with a compiled build.

The mocks run in real time (``--time-scale 1``), not the demo's 2.5× faster: the gateway's own work
per request (tokenising, applying the events: milliseconds, more in exact mode) is real wall time, which
a faster mock clock would stretch 2.5× in modelled seconds. The default rate (8 conversations per
second, about 1,470 requests over some 200 s) keeps the fleet's prefills queueing (TTFT p90 near a
second) while the gateway, the mocks and this client stay within one of the machine's two cores.

    KAPPA_PURE_PYTHON=1 python bench/index_accuracy.py --json bench/results/index_accuracy.json
    KAPPA_PURE_PYTHON=1 python bench/index_accuracy.py --conversations 100 --repetitions 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
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

import yaml  # noqa: E402

from fleet_config.catalog import default_catalog  # noqa: E402
from fleet_config.settings import Settings, load_settings, parse_settings  # noqa: E402
from gateway.commands.demo import DEFAULT_CONFIG, on_free_ports, scrape_metrics  # noqa: E402
from gateway.commands.demo_pd import since  # noqa: E402
from gateway.commands.fleet import POLL_INTERVAL_S, READY_TIMEOUT_S, mock_fleet  # noqa: E402
from gateway.commands.processes import answers_ok, stop_processes  # noqa: E402
from gateway.commands.replay import replay  # noqa: E402
from index_accuracy_probe import EventCounter, ModePoller, access_records, cpu_seconds  # noqa: E402
from index_accuracy_report import request_rows, summarise_modes, summarise_run  # noqa: E402
from index_accuracy_table import print_table  # noqa: E402
from index_accuracy_workload import Workload, WorkloadShape, build_workload  # noqa: E402

MODES = ("exact", "approximate")
CONCURRENCY = 512  # as the demo: arrivals are never held client-side
EXACT_WAIT_S = 15.0  # for every subscriber to reach exact mode before the traffic starts


def fleet_settings(config: Path, *, host_tier_gb: float, kv_pool_gb: float, seed: int) -> Settings:
    """The demo fleet on free ports, host tiers and pool cut to ``host_tier_gb`` / ``kv_pool_gb`` (0 keeps the
    config's; a negative ``kv_pool_gb`` removes the pool: private host tiers only)."""
    doc = on_free_ports(load_settings(config, default_catalog(), env={}), routing_seed=seed).model_dump(mode="json")
    for backend in doc["backends"]:
        backend["host_tier_gb"] = host_tier_gb or backend["host_tier_gb"]
    if doc.get("kv_pool") and kv_pool_gb < 0:
        doc["kv_pool"] = None
    elif doc.get("kv_pool") and kv_pool_gb:
        doc["kv_pool"]["capacity_gb"] = kv_pool_gb
    return parse_settings(doc, default_catalog(), env={})


def without_events(settings: Settings) -> Settings:
    """``settings`` with every ``models.<m>.tokenizer`` and backend ``kv_events`` removed (the approximate index)."""
    doc = settings.model_dump(mode="json")
    for model in doc.get("models", {}).values():
        model["tokenizer"] = None
    for backend in doc["backends"]:
        backend["kv_events"] = None
    return parse_settings(doc, default_catalog(), env={})


@contextmanager
def gateway_process(settings: Settings, log_path: Path) -> Iterator[tuple[str, int]]:
    """``kappa-gateway serve`` with JSON access lines to ``log_path``; yields (URL, pid) once ready."""
    doc = settings.model_dump(mode="json")
    doc["gateway"].update(access_log=True, access_log_format="json")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f)
    url = f"http://127.0.0.1:{settings.gateway.port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", f.name, "--log-level", "info"],
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not answers_ok(f"{url}/ready"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not start: {log_path.read_text()[-2000:]}")
                time.sleep(POLL_INTERVAL_S)
            yield url, proc.pid
        finally:
            stop_processes([proc], timeout_s=15)
            Path(f.name).unlink(missing_ok=True)


def backends_view(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/v1/kappa/backends", timeout=5.0) as resp:
        return json.load(resp)["backends"]


def wait_exact(url: str, n: int) -> float:
    """Seconds until all ``n`` backends show ``exact`` (raises TimeoutError after `EXACT_WAIT_S`)."""
    start = time.monotonic()
    while sum((b.get("kv_events") or {}).get("mode") == "exact" for b in backends_view(url)) < n:
        if time.monotonic() - start > EXACT_WAIT_S:
            raise TimeoutError(f"not every backend in exact mode after {EXACT_WAIT_S:g} s: {backends_view(url)}")
        time.sleep(POLL_INTERVAL_S)
    return time.monotonic() - start


def run_once(mode: str, settings: Settings, work: Workload, *, time_scale: float, engines: str,
             log_dir: Path, all_rows: bool = False) -> dict[str, Any]:
    """One mode on a fresh fleet and gateway (`fleet_settings`' ports); its `summarise_run` figures."""
    started = time.monotonic()
    gw_settings = settings if mode == "exact" else without_events(settings)
    mock_settings = gw_settings if engines == "stripped" else settings
    model = settings.served_models()[0]
    log_path = log_dir / f"gateway-{mode}.log"
    with mock_fleet(mock_settings, time_scale=time_scale) as mocks:
        counter = EventCounter(mock_settings)
        counter.start()
        with gateway_process(gw_settings, log_path) as (url, gw_pid):
            exact_wait_s = wait_exact(url, len(settings.backends)) if mode == "exact" else None
            poller = ModePoller(url)
            poller.start()
            before = {b.id: scrape_metrics(b.url) for b in settings.backends}
            cpu_before = (cpu_seconds(gw_pid), [cpu_seconds(m.proc.pid) for m in mocks])
            start_s = time.monotonic()
            results = asyncio.run(replay(work.requests, url=url, model=model, speedup=1.0 / time_scale,
                                         concurrency=CONCURRENCY, progress=False))
            cpu_after = (cpu_seconds(gw_pid), [cpu_seconds(m.proc.pid) for m in mocks])
            poller.stop()
            mock_metrics = {b.id: since(scrape_metrics(b.url), before[b.id]) for b in settings.backends}
            gw_metrics, view = scrape_metrics(url), backends_view(url)
        events = counter.stop()
    rows = request_rows(results, access_records(log_path), {"tenant": work.tenant, "conversation": work.conversation,
                        "turn": work.turn}, poller.mode_at, start_s, time_scale)
    predictions = {o: gw_metrics.get(f'gateway_index_predictions_total{{outcome="{o}"}}', 0.0)
                   for o in ("within_one_block", "over", "under")}
    extra = {
        "mode": mode, "engines": engines, "exact_wait_s": exact_wait_s, "wall_s": round(time.monotonic() - started, 1),
        "gateway_index_predictions": predictions,
        "gateway_within_index_block_share": predictions["within_one_block"] / (sum(predictions.values()) or 1),
        "events": events, "evicted_gpu_blocks": sum(c.get("removed_gpu", 0) for c in events.values()) if events else None,
        "evicted_cpu_blocks": sum(c.get("removed_cpu", 0) for c in events.values()) if events else None,
        "mode_time_shares": poller.time_shares(),
        "kv_events_batches": {b["id"]: (b.get("kv_events") or {}).get("batches") for b in view},
        "gateway_cpu_s": _delta(cpu_before[0], cpu_after[0]),
        "mocks_cpu_s": sum(_delta(a, b) or 0.0 for a, b in zip(cpu_before[1], cpu_after[1], strict=True)),
        "mock_step_lag_mean_s": {b: m.get("mock_vllm:step_lag_seconds_sum", 0.0)
                                 / max(m.get("mock_vllm:step_lag_seconds_count", 0.0), 1.0) for b, m in mock_metrics.items()},
        "mock_preemptions": {b: m.get("vllm:num_preemptions_total", 0.0) for b, m in mock_metrics.items()},
    }
    return summarise_run(rows, extra, all_rows=all_rows)


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = WorkloadShape()
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--conversations", type=int, default=shape.conversations)
    parser.add_argument("--rate", type=float, default=shape.rate_rps, help="conversations per modelled second")
    parser.add_argument("--tenants", type=int, default=shape.tenants)
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the gateway's tie-breaks")
    parser.add_argument("--host-tier-gb", type=float, default=16.0, help="every backend's host tier (0: the config's)")
    parser.add_argument("--kv-pool-gb", type=float, default=0.0, help="the shared KV pool (0: the config's; -1: none, so an evicted block is lost to its backend)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="mocks' wall seconds per modelled second (1: real time, see the module docstring)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--approximate-engines", choices=("same", "stripped"), default="same")
    parser.add_argument("--json", type=Path, default=None, help="write every run, its misses and the summary here")
    parser.add_argument("--all-rows", action="store_true", help="--json keeps every request's row, not only misses")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ends through the context managers: children stopped
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    work = build_workload(WorkloadShape(conversations=args.conversations, rate_rps=args.rate, tenants=args.tenants,
                                        seed=args.seed))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    order: list[str] = []
    with tempfile.TemporaryDirectory(prefix="index-accuracy-") as log_dir:
        for rep in range(args.repetitions):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                settings = fleet_settings(args.config, host_tier_gb=args.host_tier_gb, kv_pool_gb=args.kv_pool_gb,
                                          seed=args.seed)
                run = run_once(mode, settings, work, time_scale=args.time_scale, engines=args.approximate_engines,
                               log_dir=Path(log_dir), all_rows=args.all_rows)
                runs[mode].append(run)
                order.append(mode)
                print(f"rep {rep + 1} {mode:11s} within 16 {run['within_16_share']:.4f}  within 64 "
                      f"{run['within_64_share']:.4f}  MAE {run['mae_tokens']:.1f}  TTFT p90 {run['ttft_p90_s']:.2f} s  "
                      f"errors {run['errors']}  evicted GPU {run['evicted_gpu_blocks']}  ({run['wall_s']:.0f} s)", flush=True)
    summary = summarise_modes(runs)
    print_table(summary)
    if args.json:
        doc = {"command": " ".join(["KAPPA_PURE_PYTHON=1 python", "bench/index_accuracy.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
               "commit": _commit(), "args": {k: str(v) for k, v in vars(args).items()},
               "workload": {"requests": len(work.requests), "conversations": args.conversations,
                            "turns": {t: work.turn.count(t) for t in sorted(set(work.turn))},
                            "modelled_span_s": work.requests[-1].arrival_s, "system_prompt_bytes": work.system_prompt_bytes},
               "order": order, "summary": summary, "runs": runs}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
