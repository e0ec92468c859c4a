"""What the deployment tests share: the real CLI's parser, and the Dockerfile, compose and
Prometheus/Grafana files read once (no Docker engine runs here; nothing is built or started)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import typer
import yaml

from fleet_config import Settings, default_catalog, load_settings
from gateway.commands.cli import app

ROOT = Path(__file__).resolve().parents[1]
CATALOG = default_catalog()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROMETHEUS: dict[str, Any] = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text(encoding="utf-8"))
DASHBOARD: dict[str, Any] = json.loads((ROOT / "config/grafana/dashboards/kappa-gateway.json").read_text(encoding="utf-8"))
GRAFANA_PROVISIONING = ROOT / "config" / "grafana" / "provisioning"
ENTRY_POINT = "gateway.commands.cli:main"  # the console script that runs `app`
IMAGE_HEALTH_URL = re.compile(r"https?://127\.0\.0\.1:(\d+)/health\b")


# --- the real CLI ------------------------------------------------------------------------------

def parse_cli(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``argv`` (``kappa-gateway SUBCOMMAND [OPTIONS]``) with the real Typer app, without running it.

    Returns:
        (subcommand name, its parameters after type conversion and range checks).

    Raises:
        AssertionError: argv[0] is not the project's console script.
        LookupError: no such subcommand.
        typer/click usage errors: an unknown option, a missing value, a value of the wrong type
            or out of range (``No such option: --modle``).
    """
    scripts = PYPROJECT["project"]["scripts"]
    assert argv and scripts.get(argv[0]) == ENTRY_POINT, f"{argv[:1]} is not the console script for {ENTRY_POINT}"
    group = typer.main.get_command(app)
    assert not group.params, "the root command takes options now: argv[1] may no longer be the subcommand"
    if len(argv) < 2:
        raise LookupError("No such command: (none given)")
    with group.make_context(argv[0], list(argv[1:]), resilient_parsing=False) as ctx:
        sub = group.get_command(ctx, argv[1])
        if sub is None:
            raise LookupError(f"No such command {argv[1]!r} (have: {', '.join(group.list_commands(ctx))})")
        with sub.make_context(argv[1], list(argv[2:]), parent=ctx, resilient_parsing=False) as sub_ctx:
            return argv[1], dict(sub_ctx.params)


# --- compose and Dockerfile helpers --------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        instruction, _, args = (pending + stripped).partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


DOCKERFILE = dockerfile_instructions()


def instruction_args(name: str) -> list[str]:
    return [args for instr, args in DOCKERFILE if instr == name]


def image_workdir() -> PurePosixPath:
    workdirs = instruction_args("WORKDIR")
    assert workdirs, "the Dockerfile sets no WORKDIR"
    return PurePosixPath(workdirs[-1])


def argv_of(command: str | list[str]) -> list[str]:
    """A compose ``command`` (exec list or shell string) as argv."""
    return [str(part) for part in command] if isinstance(command, list) else shlex.split(command)


def runs_our_image(service: dict[str, Any]) -> bool:
    return "build" in service or service.get("image") == SERVICES["gateway"].get("image")


OUR_SERVICES = sorted(name for name, svc in SERVICES.items() if runs_our_image(svc))


def repo_path(container_path: Path, *, relative_to: PurePosixPath) -> Path:
    """The repo file behind a path inside the image (the Dockerfile copies the tree to WORKDIR)."""
    path = PurePosixPath(container_path)
    path = path if path.is_absolute() else relative_to / path
    assert path.is_relative_to(image_workdir()), f"{path} is outside the image's source tree {image_workdir()}"
    return ROOT / path.relative_to(image_workdir())


def copied_into_image(repo_file: Path) -> bool:
    """Whether a COPY instruction brings ``repo_file`` (relative to the build context) into the image."""
    relative = repo_file.relative_to(ROOT)
    for args in instruction_args("COPY"):
        sources = [s for s in args.split()[:-1] if not s.startswith("--")]
        if any(s in (".", "./") or relative.is_relative_to(s.rstrip("/")) for s in sources):
            return True
    return False


def published_container_ports(service: dict[str, Any]) -> set[int]:
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    return ports


def gateway_invocation() -> tuple[dict[str, Any], Settings]:
    name, params = parse_cli(argv_of(SERVICES["gateway"]["command"]))
    assert name == "serve"
    config = repo_path(params["config"], relative_to=image_workdir())
    return params, load_settings(config, CATALOG, env={})
