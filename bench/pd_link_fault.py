"""The lying link, live (issue 26): a P→D link configured at 50 GB/s that delivers 1 GB/s from the start.

Per repetition, two runs, each on a **fresh** fleet of ``config/fleet.pd.local.yaml`` (five P/D mocks
and the gateway on free loopback ports, `gateway.commands.demo.on_free_ports`; mocks at
``--time-scale``, every latency divided by it so it reads in modelled seconds, as the demo's do):

1. **kappa** (the config's policy, P/D splits): before any traffic the decode mock of the link
   (``--decode``, default h100-d0) is told to deliver ``--delivered-gb-s`` (1) from the prefill
   backend (``--prefill``, default b200-p0) (``POST /kappa/faults/link``). The first ``--requests``
   of the trace are replayed at the trace's rate (`gateway.commands.replay`, streamed, open loop)
   while ``/v1/kappa/backends`` is polled every ``POLL_S`` for the link's state. Measured: the
   requests sent before the gateway showed the link not healthy (``degraded_after_requests``: the
   index of the first request routed knowing it), the splits over the link before and after
   (``x-kappa-prefill-backend`` and ``x-kappa-backend`` of each answer), the probes seen (the gateway
   lets an unhealthy link through for one scrape window every ``probe_interval_s``, 10 s by default:
   a split over it then is a probe, by design), and the TTFT p90 of the requests from that index
   on. Then the fault is removed (``DELETE /kappa/faults/link``) and the next ``--restore-requests``
   of the trace replayed: when the link reads healthy again, and the splits over it after that.
2. **kappa-aggregated** (κ that never splits) on the same first ``--requests`` (the same fault
   set, which it never crosses): the TTFT p90 of the same requests (index ≥ the kappa run's
   ``degraded_after_requests``).

The criterion (issue 26): degraded within 100 requests, no split over it afterwards but probes,
and kappa's TTFT p90 from then on within 10% of kappa-aggregated's (``ttft_p90_ratio`` ≤ 1.10); the
link used again once restored. The summary gives medians over the repetitions.

Usage::

    python bench/pd_link_fault.py --json bench/results/pd_link_fault.json     # 400 + 200 requests × 2
    python bench/pd_link_fault.py --requests 120 --restore-requests 80 --repetitions 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import hot_path  # noqa: E402

hot_path.select()  # an entry point: compiled or source, before the project is imported

from fleet_config.catalog import CONFIG_DIR, default_catalog  # noqa: E402
from fleet_config.settings import Settings, load_settings  # noqa: E402
from gateway.commands.demo import DEFAULT_TIME_SCALE, gateway_process, on_free_ports, scrape_metrics  # noqa: E402
from gateway.commands.fleet import mock_fleet  # noqa: E402
from gateway.commands.replay import RequestResult, replay  # noqa: E402
from sim.real_traces import real_trace_path  # noqa: E402
from sim.report import percentile  # noqa: E402
from sim.traces import TraceRequest, load_trace  # noqa: E402
from sim.workloads.mooncake_like import mooncake_like  # noqa: E402
from routing_live import _commit  # noqa: E402  (bench/ is the script's own directory on sys.path)

DEFAULT_CONFIG = CONFIG_DIR / "fleet.pd.local.yaml"
DEFAULT_TRACE = real_trace_path("mooncake")
GENERATED_RATE_RPS = 2.84  # the Mooncake conversation trace's first 400 requests: 400 in 141 s
CONCURRENCY = 512  # the demo's: open loop, no client-side queueing at these rates
POLL_S = 0.1  # wall seconds between reads of /v1/kappa/backends
CRITERION_REQUESTS = 100  # degraded within this many requests (issue 26)
CRITERION_TTFT_RATIO = 1.10  # kappa's TTFT p90 after ≤ 1.10 × kappa-aggregated's (issue 26)


def workload(trace: Path, n: int, seed: int) -> tuple[list[TraceRequest], str]:
    if trace.is_file():
        return load_trace(trace, limit=n), str(trace)
    return (mooncake_like(n, rate_rps=GENERATED_RATE_RPS, seed=seed, max_input_tokens=48_000, max_output_tokens=1_024),
            f"built-in Mooncake-like generator ({trace} absent), {GENERATED_RATE_RPS} req/s, seed {seed}")


class LinkWatch:
    """Polls the gateway's ``pd_links`` for one pair: (wall s since ``start``, state, probing) per read."""

    def __init__(self, url: str, pair: tuple[str, str]) -> None:
        self.url, self.pair, self.reads = url, pair, []

    async def run(self, start: float, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not stop.is_set():
                try:
                    async with session.get(f"{self.url}/v1/kappa/backends") as resp:
                        links = (await resp.json())["pd_links"]
                    link = next(x for x in links if (x["prefill_backend"], x["decode_backend"]) == self.pair)
                    self.reads.append((loop.time() - start, link["state"], link["probing"], link["reason"]))
                except (aiohttp.ClientError, TimeoutError, KeyError, StopIteration, ValueError):
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), POLL_S)
                except TimeoutError:
                    pass

    def first(self, healthy: bool, after_s: float = 0.0) -> tuple[float, str, str] | None:
        for t, state, probing, reason in self.reads:
            if t >= after_s and (state == "healthy") == healthy and not probing:
                return t, state, reason
        return None

    def probes(self) -> int:
        """Probe windows seen: reads going from not probing to probing."""
        flags = [p for _, _, p, _ in self.reads]
        return sum(1 for a, b in zip([False, *flags], flags) if b and not a)

    def probing_at(self, t: float) -> bool:
        return any(p and abs(tr - t) <= POLL_S * 2 for tr, _, p, _ in self.reads)


async def _replay_watched(requests: Sequence[TraceRequest], url: str, model: str, speedup: float,
                          pair: tuple[str, str]) -> tuple[list[RequestResult], LinkWatch]:
    watch, stop = LinkWatch(url, pair), asyncio.Event()
    start = asyncio.get_running_loop().time()  # replay's own start is this, within a millisecond
    poller = asyncio.create_task(watch.run(start, stop))
    try:
        results = await replay(requests, url=url, model=model, speedup=speedup, concurrency=CONCURRENCY, progress=False)
    finally:
        stop.set()
        await poller
    return results, watch


def _link_fault(decode_url: str, method: str, body: dict[str, Any] | None = None) -> None:
    req = urllib.request.Request(f"{decode_url}/kappa/faults/link", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200, resp.status


def _pd_links(url: str) -> list[dict[str, Any]]:
    """Every link's state, reason and measured figure from ``/v1/kappa/backends`` (empty if unreachable)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/kappa/backends", timeout=10) as resp:
            links = json.load(resp)["pd_links"]
    except (OSError, ValueError, KeyError):
        return []
    return [{k: x[k] for k in ("prefill_backend", "decode_backend", "state", "probing", "reason",
                                "delivered_bytes_per_s", "transfers_measured")} for x in links]


def _ttft_p90(results: Sequence[RequestResult], from_index: int, time_scale: float) -> float | None:
    return percentile([r.ttft_s / time_scale for r in results if r.ok and r.index >= from_index
                       and r.ttft_s is not None], 90)


def _splits(results: Sequence[RequestResult]) -> dict[str, int]:
    pairs: dict[str, int] = {}
    for r in results:
        if r.ok and r.prefill_backend:
            key = f"{r.prefill_backend}->{r.backend}"
            pairs[key] = pairs.get(key, 0) + 1
    return dict(sorted(pairs.items()))


def run_kappa(settings: Settings, first: Sequence[TraceRequest], then: Sequence[TraceRequest], *, pair: tuple[str, str],
              delivered_gb_s: float, time_scale: float) -> tuple[dict[str, Any], list[RequestResult]]:
    """The faulted run: fault set, ``first`` replayed watched, fault removed, ``then`` replayed watched."""
    prefill_id, decode_id = pair
    decode_url = next(b.url for b in settings.backends if b.id == decode_id)
    model = settings.served_models()[0]
    started = time.monotonic()
    with mock_fleet(settings, time_scale=time_scale), gateway_process(settings) as url:
        _link_fault(decode_url, "POST", {"peer": prefill_id, "delivered_gb_s": delivered_gb_s})
        results, watch = asyncio.run(_replay_watched(first, url, model, 1.0 / time_scale, pair))
        _link_fault(decode_url, "DELETE")
        restored, rwatch = asyncio.run(_replay_watched(then, url, model, 1.0 / time_scale, pair))
        gateway_metrics = scrape_metrics(url)
        links = _pd_links(url)
        lag = {b.id: scrape_metrics(b.url) for b in settings.backends}
    on_pair = [r for r in results if r.ok and (r.prefill_backend, r.backend) == pair]
    marked = watch.first(healthy=False)
    run: dict[str, Any] = {"requests": len(results), "errors": sum(not r.ok for r in results),
                           "error_examples": sorted({r.error for r in results if r.error})[:3],
                           "splits": sum(bool(r.ok and r.prefill_backend) for r in results),
                           "splits_per_pair": _splits(results)}
    if marked is None:
        run.update(degraded_after_requests=None, state=None, reason=None, splits_over_link_before=len(on_pair),
                   ttft_p90_after_s=None)
    else:
        t_marked, state, reason = marked
        after = sum(r.sent_s <= t_marked for r in results)  # requests sent before the gateway showed it
        late = [r for r in on_pair if r.sent_s > t_marked]
        run.update(degraded_after_requests=after, degraded_at_s=round(t_marked / time_scale, 2), state=state,
                   reason=reason, splits_over_link_before=len(on_pair) - len(late),
                   splits_over_link_after=len(late), splits_over_link_after_in_probes=sum(watch.probing_at(r.sent_s)
                                                                                          for r in late),
                   probes=watch.probes(), ttft_p90_after_s=_ttft_p90(results, after, time_scale),
                   splits_after=sum(bool(r.ok and r.prefill_backend) for r in results if r.index >= after),
                   splits_per_pair_after=_splits([r for r in results if r.index >= after]))
    healthy = rwatch.first(healthy=True)
    resumed = [r for r in restored if r.ok and (r.prefill_backend, r.backend) == pair
               and (healthy is None or r.sent_s > healthy[0])]
    run["restore"] = {"requests": len(restored), "errors": sum(not r.ok for r in restored),
                      "healthy_again_at_s": None if healthy is None else round(healthy[0] / time_scale, 2),
                      "healthy_again_after_requests": None if healthy is None else sum(r.sent_s <= healthy[0]
                                                                                      for r in restored),
                      "reason": None if healthy is None else healthy[2], "probes": rwatch.probes(),
                      "splits_over_link_after_healthy": len(resumed), "splits_per_pair": _splits(restored)}
    run["gateway_pd_splits_total"] = gateway_metrics.get("gateway_pd_splits_total")  # both phases: a cross-check
    run["pd_links_at_end"] = links  # every link, not only the faulted one: collateral verdicts show here
    run["mock_step_lag_mean_s"] = _step_lag(lag)
    run["wall_s"] = round(time.monotonic() - started, 1)
    return run, results


def run_aggregated(settings: Settings, first: Sequence[TraceRequest], *, pair: tuple[str, str], delivered_gb_s: float,
                   time_scale: float) -> tuple[list[RequestResult], dict[str, float]]:
    """The same first requests through ``settings`` (kappa-aggregated), the same fault set; the results and each
    mock's mean step lag."""
    decode_url = next(b.url for b in settings.backends if b.id == pair[1])
    with mock_fleet(settings, time_scale=time_scale), gateway_process(settings) as url:
        _link_fault(decode_url, "POST", {"peer": pair[0], "delivered_gb_s": delivered_gb_s})
        results = asyncio.run(replay(first, url=url, model=settings.served_models()[0], speedup=1.0 / time_scale,
                                     concurrency=CONCURRENCY, progress=False))
        return results, _step_lag({b.id: scrape_metrics(b.url) for b in settings.backends})


def _step_lag(scraped: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each mock's mean step lag, wall s (`mock_vllm.driver`): a mock far behind stretches every latency."""
    return {b: m.get("mock_vllm:step_lag_seconds_sum", 0.0) / max(m.get("mock_vllm:step_lag_seconds_count", 0.0), 1.0)
            for b, m in scraped.items()}


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarise(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions and the issue's criterion."""
    ratios = [x["ttft_p90_ratio"] for x in reps]
    summary = {
        "degraded_after_requests": _median([x["kappa"]["degraded_after_requests"] for x in reps]),
        "degraded_after_requests_each": [x["kappa"]["degraded_after_requests"] for x in reps],
        "splits_over_link_after_each": [x["kappa"].get("splits_over_link_after") for x in reps],
        "splits_over_link_after_outside_probes_each": [
            (x["kappa"].get("splits_over_link_after") or 0) - (x["kappa"].get("splits_over_link_after_in_probes") or 0)
            for x in reps],
        "kappa_ttft_p90_after_s": _median([x["kappa"]["ttft_p90_after_s"] for x in reps]),
        "aggregated_ttft_p90_after_s": _median([x["kappa_aggregated"]["ttft_p90_after_s"] for x in reps]),
        "ttft_p90_ratio": _median(ratios), "ttft_p90_ratio_each": ratios,
        "restored_splits_over_link_each": [x["kappa"]["restore"]["splits_over_link_after_healthy"] for x in reps],
    }
    summary["criterion"] = {
        "degraded_within_100": all(x is not None and x <= CRITERION_REQUESTS for x in summary["degraded_after_requests_each"]),
        "ttft_p90_within_10pct": summary["ttft_p90_ratio"] is not None and summary["ttft_p90_ratio"] <= CRITERION_TTFT_RATIO,
        "used_again": all(n > 0 for n in summary["restored_splits_over_link_each"])}
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="default: the Mooncake conversation trace "
                        "(absent: the built-in Mooncake-like generator)")
    parser.add_argument("--requests", type=int, default=400, help="the trace's first N requests, the link faulted")
    parser.add_argument("--restore-requests", type=int, default=200, help="the next M, the fault removed")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--prefill", default="b200-p0")
    parser.add_argument("--decode", default="h100-d0")
    parser.add_argument("--delivered-gb-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # end through the context managers: children stopped
    base = load_settings(args.config, default_catalog(), env={})
    pair = (args.prefill, args.decode)
    link = base.interconnect_table().link(*pair)
    everything, source = workload(args.trace, args.requests + args.restore_requests, args.seed)
    first = everything[:args.requests]
    t0 = everything[args.requests].arrival_s if len(everything) > args.requests else 0.0
    then = [replace(r, arrival_s=r.arrival_s - t0) for r in everything[args.requests:]]
    reps: list[dict[str, Any]] = []
    for rep in range(args.repetitions):
        kappa, results = run_kappa(on_free_ports(base, routing_seed=args.seed), first, then, pair=pair,
                                   delivered_gb_s=args.delivered_gb_s, time_scale=args.time_scale)
        aggregated, agg_lag = run_aggregated(on_free_ports(base, policy="kappa-aggregated", routing_seed=args.seed), first,
                                    pair=pair, delivered_gb_s=args.delivered_gb_s, time_scale=args.time_scale)
        after = kappa["degraded_after_requests"] if kappa["degraded_after_requests"] is not None else 0
        agg = {"errors": sum(not r.ok for r in aggregated), "ttft_p90_after_s": _ttft_p90(aggregated, after, args.time_scale),
               "ttft_p90_all_s": _ttft_p90(aggregated, 0, args.time_scale), "mock_step_lag_mean_s": agg_lag}
        kappa["ttft_p90_all_s"] = _ttft_p90(results, 0, args.time_scale)
        ratio = (kappa["ttft_p90_after_s"] / agg["ttft_p90_after_s"]
                 if kappa.get("ttft_p90_after_s") and agg["ttft_p90_after_s"] else None)
        reps.append({"kappa": kappa, "kappa_aggregated": agg, "ttft_p90_ratio": ratio})
        r = kappa["restore"]
        print(f"rep {rep + 1}: {kappa['state']} after {kappa['degraded_after_requests']} requests "
              f"({kappa['splits_over_link_before']} splits over it before, {kappa.get('splits_over_link_after')} after, "
              f"{kappa.get('splits_over_link_after_in_probes')} of them in {kappa.get('probes')} probes); TTFT p90 after "
              f"{kappa['ttft_p90_after_s']} s vs aggregated {agg['ttft_p90_after_s']} s (ratio {ratio}); restored: "
              f"healthy after {r['healthy_again_after_requests']} requests, {r['splits_over_link_after_healthy']} "
              f"splits over it since; {kappa['wall_s']} s", flush=True)
    summary = summarise(reps)
    print(json.dumps(summary, indent=1))
    if args.json:
        doc = {"command": " ".join(["python", "bench/pd_link_fault.py", *(argv if argv is not None else sys.argv[1:])]),
               "commit": _commit(), "workload": source, "requests": args.requests,
               "restore_requests": args.restore_requests, "time_scale": args.time_scale, "link": list(pair),
               "configured_gb_s": None if link is None else link.bandwidth_bytes_per_s / 1e9,
               "delivered_gb_s": args.delivered_gb_s, "repetitions": reps, "summary": summary}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
