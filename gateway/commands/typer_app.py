"""The ``kappa-gateway`` typer app every command module registers on, and the config loader they share."""

from __future__ import annotations

from pathlib import Path

import typer

from fleet_config import ConfigError, Settings, default_catalog, load_settings

app = typer.Typer(
    name="kappa-gateway",
    help="κ-aware OpenAI-compatible routing gateway for heterogeneous vLLM fleets.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """κ-aware OpenAI-compatible routing gateway for heterogeneous vLLM fleets."""


def load_config(config: Path, *, overrides: bool = True) -> Settings:
    """Load a fleet config, or exit 2 with ``error: <path>: <key path>: <problem>`` on stderr.

    ``overrides=False`` ignores the ``KAPPA_*`` environment (a file written by a parent
    command that already applied them).
    """
    try:
        return load_settings(config, default_catalog(), env=None if overrides else {})
    except ConfigError as exc:
        typer.echo(f"error: {config}: {exc}" if not str(exc).startswith(str(config)) else f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
