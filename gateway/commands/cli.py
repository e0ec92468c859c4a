"""The ``kappa-gateway`` command line.

``serve`` (the gateway), ``demo`` (mock fleet + gateway + traffic + report), ``replay`` (a
trace against any OpenAI URL) and ``sim`` (policies compared in virtual time) here; ``crit``
(κ_crit for model × hardware, or for a request on a config's backends) in
`gateway.commands.crit_cli`; ``mock-vllm`` and ``mock-fleet`` (vLLM-compatible mock
backends) in `gateway.commands.mock_cli`; ``hot-path`` (what runs compiled, and the image's
check that all of it does) in `gateway.commands.hot_path_cli`; ``analyze`` (what a trace, workload or access log allows
and costs) in `gateway.commands.analyze_cli`.
"""

from __future__ import annotations

import hot_path

# The entry point of ``kappa-gateway`` and ``python -m gateway`` (and so of every command: serve,
# sim, mock-vllm, mock-fleet and its workers): compiled or source, before any is imported below.
hot_path.select()

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gateway.commands.typer_app import app, load_config
from gateway.serving import logs


def configure_logging(log_level: str, *, json_access_log: bool) -> None:
    """`gateway.serving.logs.configure_logging`, an unknown level a usage error (``--log-level``)."""
    try:
        logs.configure_logging(log_level, json_access_log=json_access_log)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from exc


# uvicorn waits forever for open streams by default (STYLE.md B7): the config sets the bound.
@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config YAML")] = Path("config/fleet.local.yaml"),
    host: Annotated[str | None, typer.Option("--host", help="listen address (default: the config's)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="listen port (default: the config's)")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="critical|error|warning|info|debug|trace")] = "info",
    workers: Annotated[int, typer.Option("--workers", min=1, help="gateway processes on the one port, each a full replica (share the Redis index and their load; gateway.serving.workers)")] = 1,
) -> None:
    """Run the gateway: an OpenAI-compatible proxy that routes the config's fleet by κ.

    SIGTERM (or Ctrl-C) drains first: /ready answers 503 for shutdown_drain_delay_s, then the
    listener closes and requests in flight get graceful_shutdown_timeout_s (gateway.serving.server).
    """
    from gateway.app import create_app
    from gateway.serving.server import GatewayServer

    settings = load_config(config)
    configure_logging(log_level, json_access_log=settings.gateway.access_log_format == "json")
    if workers > 1:
        from gateway.serving.workers import STOP_MARGIN_S, Supervisor
        from gateway.serving.server import TAIL_MARGIN_S

        if settings.index.backend != "redis":
            logging.getLogger("kappa_gateway").warning(
                "--workers %d with the memory index: each worker keeps its own index and load (set index.backend: "
                "redis, or KAPPA_REDIS_URL, so they share both)", workers)
        g = settings.gateway
        bound_s = g.shutdown_drain_delay_s + g.graceful_shutdown_timeout_s + TAIL_MARGIN_S + STOP_MARGIN_S
        raise typer.Exit(Supervisor(config, host or g.host, port or g.port, log_level, workers,
                                    stop_bound_s=bound_s).run())
    server = GatewayServer(create_app(settings), settings, host=host or settings.gateway.host,
                           port=port or settings.gateway.port, log_level=log_level.lower(), access_log=False)
    server.run()
    if server.forced:
        raise typer.Exit(1)  # a third signal cut what was in flight: not a clean stop


@app.command()
def demo(
    requests: Annotated[int, typer.Option("--requests", "-n", min=1, help="how many requests to replay")] = 400,
    trace: Annotated[Path | None, typer.Option("--trace", exists=True, dir_okay=False, help="a real trace (Mooncake JSONL, Azure CSV, ShareGPT JSON) instead of the built-in generator (not in the repository: README, \"Real traces\")")] = None,
    rate: Annotated[float, typer.Option("--rate", min=0.01, help="built-in generator's arrival rate, modelled requests/s")] = 2.5,
    speedup: Annotated[float, typer.Option("--speedup", min=0.01, help="replay a --trace this many times faster (modelled time)")] = 1.0,
    time_scale: Annotated[float, typer.Option("--time-scale", min=0.001, help="mocks' wall seconds per modelled second (0.4: 2.5x real time)")] = 0.4,
    seed: Annotated[int, typer.Option("--seed", help="the generator's seed (arrivals and prompts), and the gateway's tie-breaks' unless the config sets routing.seed")] = 0,
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config")] = Path("config/fleet.local.yaml"),
    baseline: Annotated[str, typer.Option("--baseline", help="the policy run after κ on the same requests and a fresh fleet: any policy (round-robin, least-loaded, prefix-affinity, weighted, kappa, kappa-aggregated, and on a P/D fleet such as config/fleet.pd.local.yaml the P/D anchors pd-always, pd-llmd, pd-dynamo), or none")] = "round-robin",
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Start the local mock fleet and the gateway, replay real-shaped traffic, report routing per backend;
    then the same traffic through a baseline policy on a fresh fleet, side by side."""
    from gateway.commands.demo import run_demo
    from gateway.commands.demo_report import print_report
    from router.policies import POLICY_NAMES

    if baseline != "none" and baseline not in POLICY_NAMES:
        raise typer.BadParameter(f"{baseline!r}: one of {', '.join(POLICY_NAMES)}, none", param_hint="--baseline")
    settings = load_config(config)  # fail early, with the path, on a bad config
    if not as_json:
        from gateway.commands.demo import wall_estimate_s

        then = "" if baseline == "none" else f", then the same requests through {baseline} on a fresh fleet"
        runs = 1 if baseline == "none" else 2
        est = "" if trace else f" (roughly {wall_estimate_s(requests, rate, speedup, time_scale, runs):.0f} s of wall time)"
        typer.echo(f"starting the mock fleet of {config} (time scale {time_scale:g}) and the gateway "
                   f"({settings.routing.policy}), replaying {requests} requests{then}{est}…", err=True)
    report = run_demo(requests=requests, trace=trace, rate_rps=rate, speedup=speedup, time_scale=time_scale,
                      seed=seed, config=config, baseline=None if baseline == "none" else baseline,
                      progress=not as_json)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report, Console())
    if report["errors"] or (report["baseline"] or {}).get("errors"):
        raise typer.Exit(1)


@app.command("sim")
def sim_cmd(
    fleet: Annotated[Path, typer.Option("--fleet", "-f", exists=True, dir_okay=False,
                                        help="fleet config YAML, e.g. config/fleets/heterogeneous.yaml")],
    trace: Annotated[Path | None, typer.Option("--trace", exists=True, dir_okay=False,
                                               help="Mooncake .jsonl or Azure .csv trace (README, \"Real traces\")")] = None,
    workload: Annotated[str | None, typer.Option("--workload", help="a named workload instead of --trace (sim.workloads.WORKLOADS): mooncake, mooncake-like, azure-conv, azure-code, chat, chat-sliding-window, document-qa, agentic-coding")] = None,
    policies: Annotated[str, typer.Option("--policies", help="comma-separated policies to compare")] = "kappa,round-robin,least-loaded,prefix-affinity,weighted",
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="only the first N requests (a workload: N requests)")] = None,
    rate_scale: Annotated[float, typer.Option("--rate-scale", help="arrivals this many times as frequent, > 0")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="tie-break (and workload) seed")] = 0,
    kv_pool_gb: Annotated[float | None, typer.Option("--kv-pool-gb", help="give the fleet a shared KV pool of this many GB, > 0 (replaces the config's kv_pool)")] = None,
    gateway_replicas: Annotated[int, typer.Option("--gateway-replicas", min=1, help="gateway replicas routing the trace (a load balancer spreads requests over them)")] = 1,
    replica_state: Annotated[str, typer.Option("--replica-state", help="synced: as the gateway shares its load through Redis (own ledgers + the others' read at each decision, chains recorded when sent); local: each replica alone; shared: one ledger set (the ideal)")] = "synced",
    index_lag_ms: Annotated[float, typer.Option("--index-lag-ms", min=0.0, help="ms from a record to its chain being visible in the shared index (a Redis write's round trip)")] = 1.0,
    balancer: Annotated[str, typer.Option("--balancer", help="round-robin | random: how requests reach the replicas")] = "round-robin",
    client_concurrency: Annotated[int | None, typer.Option("--client-concurrency", min=1, help="most requests in flight, later arrivals wait client-side (as replay --concurrency; latencies from the send)")] = None,
    fleet_truth: Annotated[Path | None, typer.Option("--fleet-truth", exists=True, dir_okay=False, help="the engines run this fleet's backends (same ids), the router is told --fleet and measures: uncorrected, corrected and routed-on-truth runs per policy")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Compare routing policies on a trace and fleet in virtual time (the real router and index, mock engines)."""
    from gateway.commands.sim_command import load_requests, print_sim_report, run_sim
    from gateway.commands.sim_truth import print_truth_report, run_truth_sim

    if rate_scale <= 0:
        raise typer.BadParameter(f"must be > 0, got {rate_scale}", param_hint="--rate-scale")
    if kv_pool_gb is not None and kv_pool_gb <= 0:
        raise typer.BadParameter(f"must be > 0, got {kv_pool_gb:g}", param_hint="--kv-pool-gb")
    load_config(fleet)  # fail early, with the path, on a bad config
    names = [p.strip() for p in policies.split(",") if p.strip()]
    from sim.replicas import Topology

    if replica_state not in ("synced", "local", "shared"):
        raise typer.BadParameter(f"{replica_state!r}: one of synced, local, shared", param_hint="--replica-state")
    if balancer not in ("round-robin", "random"):
        raise typer.BadParameter(f"{balancer!r}: one of round-robin, random", param_hint="--balancer")
    topology = Topology(gateway_replicas, replica_state, index_lag_ms / 1000, balancer)  # type: ignore[arg-type]
    try:
        if fleet_truth is not None:
            load_config(fleet_truth)
            report = run_truth_sim(load_requests(trace, workload, limit, seed), fleet, fleet_truth, names,
                                   rate_scale=rate_scale, seed=seed, kv_pool_gb=kv_pool_gb, workers=1)
            return typer.echo(json.dumps(report, indent=2)) if as_json else print_truth_report(report, Console())
        report = run_sim(trace, workload, fleet, names, limit, rate_scale, seed, kv_pool_gb=kv_pool_gb,
                         client_concurrency=client_concurrency,
                         topology=topology)
    except ValueError as exc:  # both/neither of --trace and --workload, unknown workload or policy, bad trace
        raise typer.BadParameter(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_sim_report(report, Console())


@app.command("replay")
def replay_trace(
    trace: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Mooncake .jsonl, Azure .csv or ShareGPT .json")],
    url: Annotated[str, typer.Option("--url", help="base URL of an OpenAI-compatible server (gateway, vLLM, mock)")],
    model: Annotated[str | None, typer.Option("--model", help="model name (default: the first id at {url}/v1/models)")] = None,
    trace_format: Annotated[str, typer.Option("--format", help="auto | mooncake | azure | sharegpt")] = "auto",
    speedup: Annotated[float, typer.Option("--speedup", help="trace seconds per wall second, > 0")] = 1.0,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="replay only the first N requests")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="most requests in flight")] = 64,
    out: Annotated[Path | None, typer.Option("--out", dir_okay=False, help="write one JSON line per result")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Replay a trace open-loop against URL; print TTFT/E2E, cache hits and routing per backend."""
    import asyncio
    import contextlib

    from gateway.commands.replay import ReplayError, RequestResult, first_model_id, replay
    from gateway.commands.replay_report import print_summary, summarize
    from sim.traces import load_trace

    if speedup <= 0:
        raise typer.BadParameter(f"must be > 0, got {speedup}", param_hint="--speedup")
    try:
        requests = load_trace(trace, trace_format, limit)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="TRACE") from exc
    try:
        model = model or asyncio.run(first_model_id(url))
    except (ReplayError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--url") from exc
    with out.open("w", encoding="utf-8") if out else contextlib.nullcontext() as sink:
        def write(result: RequestResult) -> None:  # buffered lines, in completion order; each names its index
            sink.write(json.dumps(result.as_dict()) + "\n")

        try:
            results = asyncio.run(replay(requests, url=url, model=model, speedup=speedup, concurrency=concurrency,
                                         on_result=write if sink else None))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--url") from exc
    summary = summarize(results)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        print_summary(summary, Console(), concurrency=concurrency)
    if summary["errors"]:
        raise typer.Exit(1)  # a replay with failed requests is a failed run (scripts and CI can tell)


from gateway.commands import analyze_cli, crit_cli, hot_path_cli, mock_cli  # noqa: E402,F401 -- register analyze, crit; hot-path; mock-vllm, mock-fleet, mock-fleet-worker


def main() -> None:
    """Console-script entry point."""
    app()
