"""The ``kappa-gateway`` command line.

Subcommands so far: ``crit`` (κ_crit table for model × hardware). ``serve``, ``demo``,
``mock-vllm``, ``replay`` and ``sim`` arrive with their issues; until then they are absent,
not stubbed.
"""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gateway.catalog import default_catalog
from gateway.crit import CritRow, crit_rows
from router.errors import ProfileError

app = typer.Typer(
    name="kappa-gateway",
    help="κ-aware OpenAI-compatible routing gateway for heterogeneous vLLM fleets.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """κ-aware OpenAI-compatible routing gateway for heterogeneous vLLM fleets."""


def _fmt_crit(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.2f}"


def _json_crit(row: CritRow) -> dict:
    out = row.as_dict()
    if math.isinf(row.kappa_crit):
        out["kappa_crit"] = None  # null: no κ_ratio makes this pair transfer-bound at this T
    return out


@app.command()
def crit(
    model: Annotated[list[str], typer.Option("--model", "-m", help="catalog model name, repeatable, or 'all'")] = ["all"],
    hardware: Annotated[list[str], typer.Option("--hardware", "-w", help="catalog hardware name, repeatable, or 'all'")] = ["all"],
    kappa_hw: Annotated[float | None, typer.Option("--kappa-hw", help="use this κ_HW (byte/FLOP) for every pair, e.g. 34e-6")] = None,
    link_gbps: Annotated[float | None, typer.Option("--link-gbps", help="sustained host-link bandwidth in GB/s (gigabytes per second)")] = None,
    c_eff_tflops: Annotated[float | None, typer.Option("--c-eff-tflops", help="effective prefill compute in TFLOP/s")] = None,
    new_tokens: Annotated[int | None, typer.Option("--new-tokens", "-T", min=1, help="T for the attention-aware κ_crit(T)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON list instead of a table")] = False,
) -> None:
    """κ_crit for models × hardware: above it, a request's cached-KV load outlasts its prefill."""
    try:
        rows = crit_rows(
            default_catalog(), model, hardware,
            kappa_hw_override=kappa_hw, link_gb_s=link_gbps, c_eff_tflops=c_eff_tflops, new_tokens=new_tokens,
        )
    except ProfileError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps([_json_crit(r) for r in rows], indent=2))
        return
    title = "κ_crit = κ_M · κ_HW" + (f" (attention-aware, T={new_tokens})" if new_tokens else " (linear F_pf)")
    table = Table(title=title)
    table.add_column("model", no_wrap=True)
    table.add_column("hardware", no_wrap=True)
    for col in ("B_kv B/tok", "κ_M FLOP/B", "link GB/s", "C_eff TF/s", "κ_HW ×1e-6", "κ_crit"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.model, r.hardware, f"{r.b_kv_bytes:,.0f}", f"{r.kappa_m:,.0f}", f"{r.link_gb_s:.1f}",
            f"{r.c_eff_tflops:.0f}", f"{r.kappa_hw * 1e6:.1f}", _fmt_crit(r.kappa_crit),
        )
    Console(width=max(Console().width, 110)).print(table)
    typer.echo(
        "A request is transfer-bound on a backend when K_host / T exceeds its κ_crit. "
        "Sliding-window models: B_kv is nominal over all layers (--json adds b_kv_full_attention_bytes)."
    )


def main() -> None:
    """Console-script entry point."""
    app()
