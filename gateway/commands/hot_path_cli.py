"""``kappa-gateway hot-path``: what of the compiled hot path this install runs, and, with
``--require-compiled``, the check that it runs all of it (issue 27).

The image's build runs the check (Dockerfile), so a build that compiled only part of the hot
path — no ``xxhash.h``, a mypyc failure, the mypyc group library missing beside its shims —
fails there instead of shipping an image that routes in pure Python. It counts what is really
loaded, not the files a build left: after `hot_path.select` (the CLI's first act) it imports
every module of ``hot_path.MYPYC_MODULES`` and ``hot_path.C_EXTENSIONS`` and asks
`hot_path.compiled_modules` which came from compiled extensions.
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

import hot_path
from gateway.commands.typer_app import app


def expected_compiled() -> list[str]:
    """Every module the compiled build replaces, dotted (``router.cost``, ``prefix_index._chain``)."""
    return sorted({m.removesuffix(".py").replace("/", ".") for m in hot_path.MYPYC_MODULES} | set(hot_path.C_EXTENSIONS))


def not_compiled() -> list[str]:
    """The modules of `expected_compiled` that this process loads from source (or cannot load at
    all: a C extension has no Python source), sorted. Imports each of them."""
    for name in expected_compiled():
        try:
            importlib.import_module(name)
        except ImportError:  # prefix_index._chain where it was not built: only its wrapper's fallback runs
            continue
    return sorted(set(expected_compiled()) - set(hot_path.compiled_modules()))


@app.command("hot-path")
def hot_path_cmd(
    require_compiled: Annotated[bool, typer.Option(
        "--require-compiled", help="exit 1 unless every hot-path module runs compiled (the image's build check)")] = False,
) -> None:
    """Say what runs compiled (mypyc modules, C block hashing) and what runs as Python; exit 1 with
    --require-compiled when any of it runs as Python."""
    described = hot_path.describe()
    missing = not_compiled()
    typer.echo(f"hot path: {described}")
    if missing:
        typer.echo(f"hot path: {len(missing)} of {len(expected_compiled())} modules run as Python: "
                   f"{', '.join(missing)}")
    if require_compiled and missing:
        typer.echo(f"error: --require-compiled: the build is not fully compiled (apt-get install "
                   f"{' '.join(hot_path.BUILD_PACKAGES)}, then pip install -e . again)", err=True)
        raise typer.Exit(1)
