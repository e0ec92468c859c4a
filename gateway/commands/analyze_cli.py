"""``kappa-gateway analyze``: the options and the printed report (figures: `gateway.commands.analyze`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fleet_config.catalog import default_catalog
from gateway.commands.analyze import (
    analyze_access_log,
    analyze_views,
    config_rows,
    hardware_rows,
    load_requests,
    read_access_log,
)
from gateway.commands.typer_app import app, load_config
from prefix_index.canonical import CanonicalizationError
from router.errors import ProfileError
from sim.analysis import prompt_views


@app.command("analyze")
def analyze_cmd(
    trace: Annotated[Path | None, typer.Argument(exists=True, dir_okay=False, help="Mooncake .jsonl, Azure .csv or ShareGPT .json")] = None,
    workload: Annotated[str | None, typer.Option("--workload", help="a named workload instead of a trace (sim.workloads.WORKLOADS; chat and chat-sliding-window with their messages)")] = None,
    access_log: Annotated[Path | None, typer.Option("--access-log", exists=True, dir_okay=False, help="the gateway's access log (JSON or text lines) instead of a trace")] = None,
    requests: Annotated[int | None, typer.Option("--requests", "-n", min=1, help="the first N requests (a workload: N; default 2000; a trace: all)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="a generated workload's seed")] = 0,
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config: its backends are priced, its first model and index block hash the prompts")] = Path("config/fleet.local.yaml"),
    hardware: Annotated[list[str] | None, typer.Option("--hardware", "-w", help="price catalog hardware instead of the config's backends (repeatable, or all)")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="catalog model of the --hardware rows (default: the config's first model's profile)")] = None,
    tensor_parallel: Annotated[int, typer.Option("--tensor-parallel", min=1, help="TP of the --hardware rows")] = 1,
    link_gb_s: Annotated[float | None, typer.Option("--link-gb-s", min=0.001, help="what-if: a measured sustained host link, GB/s for the TP group")] = None,
    host_tier_gb: Annotated[float | None, typer.Option("--host-tier-gb", min=0.0, help="what-if: a host tier of this many GB on every row")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """The hit ratio a workload allows, its κ_ratio, transfer-bound shares per backend, the tokens prefix
    invalidation costs by cause, and what an FP8 KV cache, a measured link or a larger host tier would change."""
    if sum(x is not None for x in (trace, workload, access_log)) != 1:
        raise typer.BadParameter("give exactly one of TRACE, --workload and --access-log")
    settings = load_config(config)
    catalog = default_catalog()
    served = settings.served_models()[0]
    try:
        rows = (hardware_rows(catalog, catalog.model(model) if model else settings.model_profile(catalog, served),
                              hardware, tensor_parallel=tensor_parallel)
                if hardware else config_rows(settings, catalog))
    except ProfileError as exc:
        raise typer.BadParameter(str(exc), param_hint="--hardware/--model") from exc
    if access_log is not None:
        report = analyze_access_log(read_access_log(access_log), rows, link_gb_s=link_gb_s)
        source: dict[str, Any] = {"access_log": str(access_log)}
    else:
        try:
            views = prompt_views(load_requests(trace, workload, requests, seed), model=served,
                                 block_size_tokens=settings.index.block_size_tokens)
        except (ValueError, CanonicalizationError) as exc:
            raise typer.BadParameter(str(exc), param_hint="TRACE/--workload") from exc
        report = analyze_views(views, rows, link_gb_s=link_gb_s, host_tier_gb=host_tier_gb)
        source = {"trace": str(trace)} if trace is not None else {"workload": workload, "seed": seed}
    report = {"source": source, **report}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report, Console(width=max(Console().width, 160)))


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _num(value: float | None) -> str:
    return "–" if value is None else "never" if value == float("inf") else f"{value:,.1f}"


def print_report(report: dict[str, Any], console: Console) -> None:
    """The report as three tables (workload, prefix invalidation, transfer-bound shares) and its notes."""
    w = report["workload"]
    table = Table(title=f"Workload: {', '.join(f'{k} {v}' for k, v in report['source'].items())}")
    for col in ("requests", "prompt tokens", "hit ratio allowed", "append-only hit ratio", "κ_ratio p50", "p90", "p99"):
        table.add_column(col, justify="right")
    allowed = w.get("hit_ratio_allowed")
    append_only = w.get("hit_ratio_append_only")
    table.add_row(f"{w['requests']:,}", f"{w['prompt_tokens']:,.0f}",
                  _ratio(allowed) if allowed is not None else f"– (as routed {_ratio(w.get('hit_ratio_as_routed'))})",
                  _ratio(append_only), *(_num(w["kappa_ratio"][p]) for p in ("p50", "p90", "p99")))
    console.print(table)
    inv = report["invalidation"]
    if inv["available"]:
        table = Table(title="Prefix invalidation: tokens re-prefilled because a request rewrote an earlier context")
        for col in ("cause", "requests", "tokens", "share of prompt tokens"):
            table.add_column(col, justify="left" if col == "cause" else "right")
        for cause, figures in inv["by_cause"].items():
            share = figures["tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
            table.add_row(cause, f"{figures['requests']:,}", f"{figures['tokens']:,}", _ratio(share))
        console.print(table)
    _print_backends(report["backends"], console)
    for note in report["notes"]:
        console.print(f"note: {note}")


def _print_backends(backends: list[dict[str, Any]], console: Console) -> None:
    if not backends:
        return
    what_ifs = list(backends[0]["what_if"])
    table = Table(title="Transfer-bound share with K loaded from the host tier (router.cost.predict), and what-ifs",
                  caption="what-if cells: hit ratio / transfer-bound share")
    cols = ["backend", "hardware", "link GB/s", "host GB", "hit", "κ p50", "κ p90", "κ_crit p50", "transfer"]
    labels = {"fp8_kv": "FP8 KV", "link_gb_s": "link {link_gb_s:g} GB/s", "host_tier_gb": "host {host_tier_gb:g} GB"}
    for col in cols + [labels[k].format(**backends[0]["what_if"][k]) for k in what_ifs]:
        table.add_column(col, justify="left" if col in ("backend", "hardware") else "right", no_wrap=True)
    for b in backends:
        base = b["baseline"]
        tier = base["host_tier_gb"]
        cells = [b["name"], f"{b['hardware']} x{b['tensor_parallel']}", f"{b['link_gb_s']:.0f}",
                 "unbounded" if tier is None else f"{tier:g}", _ratio(base["hit_ratio"]), _num(base["kappa_ratio"]["p50"]),
                 _num(base["kappa_ratio"]["p90"]), "never" if base["kappa_crit_p50"] is None else _num(base["kappa_crit_p50"]),
                 _ratio(base["transfer_bound_share"])]
        cells += [f"{_ratio(b['what_if'][k]['hit_ratio'])} / {_ratio(b['what_if'][k]['transfer_bound_share'])}"
                  for k in what_ifs]
        table.add_row(*cells)
    console.print(table)
