"""``kappa-gateway crit``: κ_crit tables for model × hardware, or for backends of a fleet config.

The figures are `gateway.commands.crit`'s; this module parses the options and prints them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fleet_config.catalog import default_catalog
from gateway.commands.crit import BackendCritRow, CritRow, backend_crit_rows, crit_rows
from gateway.commands.crit_measured import deviation_lines, estimates, load_measured
from gateway.commands.typer_app import app, load_config
from router.errors import ProfileError

FOOTNOTE = (
    "kappa_crit_linear = κ_M·κ_HW with linear F_pf at the host link (the paper's per-backend figure, T-independent). "
    "kappa_crit = a request's own threshold at its T (and K_hbm), over the link its loads cross: the request is "
    "transfer-bound when kappa_ratio_loaded = K_loaded/T (host tier + KV pool tokens) exceeds it; 'never' = no K "
    "makes it so (attention grows with K too). Sliding-window models: B_kv is nominal over all layers (--json adds "
    "b_kv_full_attention_bytes)."
)


def _fmt_crit(value: float | None) -> str:
    return "–" if value is None else "never" if math.isinf(value) else f"{value:.2f}"


def _print_catalog_rows(rows: list[CritRow], uncached_prompt_tokens: int | None) -> None:
    title = "κ_crit_linear = κ_M · κ_HW" + (f"; κ_crit at T={uncached_prompt_tokens}, nothing in HBM, host link"
                                          if uncached_prompt_tokens else "")
    table = Table(title=title)
    table.add_column("model", no_wrap=True)
    table.add_column("hardware", no_wrap=True)
    cols = ["B_kv B/tok", "κ_M FLOP/B", "link GB/s", "C_eff TF/s", "κ_HW ×1e-6", "κ_crit_linear"]
    for col in cols + ([f"κ_crit T={uncached_prompt_tokens}"] if uncached_prompt_tokens else []):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        cells = [r.model, r.hardware, f"{r.b_kv_bytes:,.0f}", f"{r.kappa_m:,.0f}", f"{r.link_gb_s:.1f}",
                 f"{r.c_eff_tflops:.0f}", f"{r.kappa_hw * 1e6:.1f}", _fmt_crit(r.kappa_crit_linear)]
        table.add_row(*cells, *([_fmt_crit(r.kappa_crit)] if uncached_prompt_tokens else []))
    Console(width=max(Console().width, 150)).print(table)


def _print_backend_rows(rows: list[BackendCritRow]) -> None:
    r0 = rows[0]
    table = Table(title=f"κ_crit of a request with T={r0.uncached_prompt_tokens}, K cached {r0.cached_hbm_tokens} in "
                        f"HBM / {r0.cached_host_tokens} host tier / {r0.cached_kv_pool_tokens} KV pool "
                        "(as the gateway computes it)")
    for col in ("backend", "hardware", "link GB/s", "pool GB/s", "C_eff TF/s", "κ_crit_linear", "κ_ratio",
                "κ_ratio_loaded", "κ_crit", "regime"):
        table.add_column(col, justify="left" if col in ("backend", "hardware", "regime") else "right", no_wrap=True)
    for r in rows:
        name = r.backend if r.source == "profile" else f"  measured ({', '.join(r.measured)})"
        table.add_row(name, f"{r.hardware} x{r.tensor_parallel}", f"{r.link_gb_s:.0f}",
                      "–" if r.kv_pool_link_gb_s is None else f"{r.kv_pool_link_gb_s:.0f}", f"{r.c_eff_tflops:.0f}",
                      _fmt_crit(r.kappa_crit_linear), f"{r.kappa_ratio:.4g}", f"{r.kappa_ratio_loaded:.4g}",
                      _fmt_crit(r.kappa_crit), r.regime)
    Console(width=max(Console().width, 150)).print(table)


def _backend_crit(config: Path, backend: list[str], measured: str | None, shape: tuple[int, int, int, int],
                  as_json: bool) -> None:
    """``crit --backend``: rows from the config (and the measured figures), printed or as JSON."""
    settings = load_config(config)
    uncached, hbm, host, kv_pool = shape
    try:
        found = None if measured is None else {k: estimates(v) for k, v in load_measured(measured).items()}
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--measured") from exc
    try:
        rows = backend_crit_rows(settings, default_catalog(), backend, uncached_prompt_tokens=uncached,
                                 cached_hbm_tokens=hbm, cached_host_tokens=host, cached_kv_pool_tokens=kv_pool,
                                 measured=found)
    except (KeyError, ValueError) as exc:
        raise typer.BadParameter(str(exc).strip("'\""), param_hint="--backend") from exc
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    _print_backend_rows(rows)
    ratio = settings.routing.measured_figures.deviation_ratio
    for backend_id, factors in (found or {}).items():
        for line in deviation_lines(backend_id, factors, ratio):
            typer.echo(line)
    typer.echo(FOOTNOTE)


@app.command()
def crit(
    model: Annotated[list[str], typer.Option("--model", "-m", help="catalog model name, repeatable, or 'all'")] = ["all"],
    hardware: Annotated[list[str], typer.Option("--hardware", "-w", help="catalog hardware name, repeatable, or 'all'")] = ["all"],
    kappa_hw: Annotated[float | None, typer.Option("--kappa-hw", help="use this κ_HW (byte/FLOP) for every pair, e.g. 34e-6")] = None,
    link_gbps: Annotated[float | None, typer.Option("--link-gbps", help="sustained host-link bandwidth in GB/s (gigabytes per second)")] = None,
    c_eff_tflops: Annotated[float | None, typer.Option("--c-eff-tflops", help="effective prefill compute in TFLOP/s")] = None,
    uncached_prompt_tokens: Annotated[int | None, typer.Option("--uncached-tokens", "-T", "--new-tokens", min=1, help="T, the uncached prompt tokens to prefill, for the attention-aware κ_crit(T)")] = None,
    backend: Annotated[list[str] | None, typer.Option("--backend", "-b", help="a backend id of --config (repeatable, or 'all'): κ_crit as the gateway computes it there; needs -T")] = None,
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config, with --backend")] = Path("config/fleet.local.yaml"),
    cached_hbm_tokens: Annotated[int, typer.Option("--cached-hbm-tokens", min=0, help="with --backend: K already in HBM (read in place)")] = 0,
    cached_host_tokens: Annotated[int, typer.Option("--cached-host-tokens", min=0, help="with --backend: K in the host tier (loaded over the host link)")] = 0,
    cached_kv_pool_tokens: Annotated[int, typer.Option("--cached-kv-pool-tokens", min=0, help="with --backend: K only in the fleet's KV pool (loaded over the pool link)")] = 0,
    measured: Annotated[str | None, typer.Option("--measured", help="with --backend: a gateway URL (its /v1/kappa/backends) or a saved copy of that JSON: each backend's measured figures beside its profile's")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON list instead of a table")] = False,
) -> None:
    """κ_crit for models × hardware, or for a request on backends of a fleet config: above it, a
    request's cached-KV load outlasts its prefill."""
    for flag, value in (("--kappa-hw", kappa_hw), ("--link-gbps", link_gbps), ("--c-eff-tflops", c_eff_tflops)):
        if value is not None and not value > 0:
            raise typer.BadParameter(f"{flag} must be > 0, got {value:g}")
    if kappa_hw is not None and (link_gbps is not None or c_eff_tflops is not None):
        raise typer.BadParameter("--kappa-hw replaces κ_HW = link / C_eff: give it, or --link-gbps/--c-eff-tflops, not both")
    if backend:
        if uncached_prompt_tokens is None:
            raise typer.BadParameter("--backend needs -T (the request's uncached prompt tokens)")
        if model != ["all"] or hardware != ["all"] or any(v is not None for v in (kappa_hw, link_gbps, c_eff_tflops)):
            raise typer.BadParameter("--backend reads model and links from --config: drop -m/-w/--kappa-hw/"
                                     "--link-gbps/--c-eff-tflops")
        _backend_crit(config, backend, measured, (uncached_prompt_tokens, cached_hbm_tokens, cached_host_tokens,
                                                  cached_kv_pool_tokens), as_json)
        return
    if measured is not None:
        raise typer.BadParameter("--measured needs --backend (the figures are a configured backend's)")
    if cached_hbm_tokens or cached_host_tokens or cached_kv_pool_tokens:
        raise typer.BadParameter("--cached-*-tokens need --backend (the link they cross is the backend's)")
    try:
        rows = crit_rows(default_catalog(), model, hardware, kappa_hw_override=kappa_hw, link_gb_s=link_gbps,
                         c_eff_tflops=c_eff_tflops, uncached_prompt_tokens=uncached_prompt_tokens)
    except ProfileError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    _print_catalog_rows(rows, uncached_prompt_tokens)
    typer.echo(FOOTNOTE)
