"""Which build of the per-request hot path runs: the compiled modules or their Python sources.

Two kinds of compiled code (what is compiled, and why, is measured by `bench/hot_path_bench.py`;
BENCHMARKS.md "The hot path"):

- ``MYPYC_MODULES``: the κ cost model, candidates, policies, the in-memory index and the
  ledger, compiled by mypyc from the very Python files that define them (one definition of
  the κ model; the ``.py`` is the source of truth and the fallback);
- ``C_EXTENSIONS``: ``prefix_index._chain``, the chained XXH3 block hashes in C
  (`prefix_index.hashing.block_hashes` is the definition and the fallback).

``setup.py`` builds both when it can (a C compiler, mypy, xxhash.h) and installs pure Python
when it cannot. At run time the sources are used instead of a compiled module when:

- ``KAPPA_PURE_PYTHON`` is set to a non-empty value other than ``0`` (also honoured at build
  time: nothing is compiled), e.g. to compare the two (`bench/hot_path_bench.py --both`);
- any compiled module is older than its source (an edited tree not rebuilt): all sources
  are used, with one warning saying to re-run ``pip install -e .``, so an edit always runs.

The choice is all or nothing (mypyc calls between compiled modules natively, so a compiled
module never runs beside the source of another) and is made once per process by `select`,
which the entry points call before they import anything compiled: the ``kappa-gateway``
command line (`gateway.commands.cli`, also ``python -m gateway``), the app factory's module
(`gateway.app`, for a server that imports it to build the app, ``uvicorn --factory`` or a
``serve --workers`` worker), the ``bench/`` scripts and the tests' ``conftest.py``. Importing a
package never selects: a program that imports ``router`` without calling `select` runs whatever
the import system finds (the build, if any). A `select` that comes after a compiled module was
imported and would choose the sources keeps the build (all or nothing) and warns, naming the
modules.

This room imports nothing of the project (it sits below every package that uses it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE_PYTHON_ENV = "KAPPA_PURE_PYTHON"

# Compiled together by mypyc (one group): the modules a routing decision runs, and the
# in-memory index and ledger its bookkeeping runs. Not here: modules with pydantic models
# or runtime-checkable protocols (profiles, base), exceptions, and classes that interpreted
# code subclasses (dispatch.target.Target, dispatch.pipeline.RoutableRequest).
MYPYC_MODULES = (
    "router/kappa.py",
    "router/cost.py",
    "router/types.py",
    "router/candidates.py",
    "router/decode.py",
    "router/pd.py",
    "router/decide.py",
    "router/calibration.py",
    "router/policies/base.py",
    "router/policies/kappa.py",
    "router/policies/least_loaded.py",
    "router/policies/prefix_affinity.py",
    "router/policies/round_robin.py",
    "router/policies/weighted.py",
    "prefix_index/memory_index.py",
    "prefix_index/pending.py",
    "prefix_index/kv_pool.py",
    "dispatch/ledger.py",
    "dispatch/evidence.py",
)
MYPYC_GROUP = "kappa_hot_path"
# name -> C sources (the header-only xxHash comes from the system's libxxhash-dev).
C_EXTENSIONS = {"prefix_index._chain": ("prefix_index/_chain.c",)}
BUILD_PACKAGES = ("gcc", "libc6-dev", "libxxhash-dev")
"""The Debian packages the compiled build needs (``setup.py``): a C compiler, the C library's
headers and the header-only xxHash (``xxhash.h``, for ``prefix_index._chain``); mypy, which
brings mypyc, comes with the build's own requirements (pyproject.toml). A Python without its
headers (Debian's own ``python3``) also needs ``python3-dev``. The README's set-up, the
Dockerfile and .ci/run install exactly these (tests/test_build_reporting.py)."""
_REBUILD_HINT = (f"the build needs {', '.join(BUILD_PACKAGES)} and Python's headers, then pip install -e . "
                 "again; pip install -v -e . says what it lacked")

log = logging.getLogger("kappa_gateway.hot_path")
_decision: str | None = None  # None until `select` ran: "compiled" or why the sources run


def pure_python_requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """``KAPPA_PURE_PYTHON`` is set to a non-empty value other than ``0``."""
    return environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def _extension_of(anchor: Path) -> Path | None:
    """The compiled module built for ``anchor`` (``router/cost.py`` ->
    ``router/cost.cpython-311-x86_64-linux-gnu.so``), if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = anchor.with_name(anchor.stem + suffix)
        if built.exists():
            return built
    return None


def _builds(root: Path) -> list[tuple[Path, tuple[Path, ...]]]:
    """(module path as a ``.py`` anchor, the files it is built from) for every compiled module."""
    builds: list[tuple[Path, tuple[Path, ...]]] = [(root / m, (root / m,)) for m in MYPYC_MODULES]
    builds += [(root / (name.replace(".", "/") + ".py"), tuple(root / s for s in sources))
               for name, sources in C_EXTENSIONS.items()]
    return builds


def stale_modules(root: Path = ROOT) -> list[str]:
    """Compiled modules under ``root`` older than a file they are built from (module paths
    relative to ``root``, without suffix).

    A mypyc module is two files: a small shim named after the module and the group's library
    (``MYPYC_GROUP``), which holds the code. A rebuild rewrites the library but copies a shim
    only when it changed, so a module counts as built at the later of the two: an in-place
    rebuild after an edit is not taken for a stale build."""
    group = _extension_of(root / f"{MYPYC_GROUP}__mypyc.py")
    group_mtime = group.stat().st_mtime if group is not None else 0.0
    mypyc = {root / m for m in MYPYC_MODULES}
    stale = []
    for anchor, inputs in _builds(root):
        built = _extension_of(anchor)
        if built is None:
            continue
        built_mtime = max(built.stat().st_mtime, group_mtime) if anchor in mypyc else built.stat().st_mtime
        if any(i.exists() and i.stat().st_mtime > built_mtime for i in inputs):
            stale.append(anchor.relative_to(root).with_suffix("").as_posix())
    return stale


def _shims_without_group() -> bool:
    """Some mypyc module was built but not the group library its code lives in."""
    if not built()[0]:
        return False
    return _extension_of(ROOT / f"{MYPYC_GROUP}__mypyc.py") is None and \
        importlib.util.find_spec(f"{MYPYC_GROUP}__mypyc") is None


def _use_sources() -> None:
    """Make every directory holding compiled modules import from ``.py`` files only: its
    path-entry finder is replaced by one without the extension-module loader."""
    loaders = [(importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
               (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES)]
    directories = {str((ROOT / m).parent) for m in MYPYC_MODULES}
    directories |= {str((ROOT / name.replace(".", "/")).parent) for name in C_EXTENSIONS}
    for directory in directories:
        sys.path_importer_cache[directory] = importlib.machinery.FileFinder(directory, *loaders)


def _why_sources() -> str | None:
    """Why the sources should run (``"pure Python (...)"``), or None: the build runs."""
    if pure_python_requested():
        return f"pure Python ({PURE_PYTHON_ENV} is set)"
    # In a source checkout (setup.py beside the packages) an edit may postdate the build; an
    # installed wheel's files are all written after its compiled modules, and are not edited.
    stale = stale_modules() if (ROOT / "setup.py").exists() else []
    if stale:
        more = ", ..." if len(stale) > 3 else ""
        why = (f"pure Python (compiled modules older than their source: {', '.join(stale[:3])}{more}; "
               "re-run pip install -e . to rebuild them)")
        log.warning("hot path: %s", why)
        return why
    if _shims_without_group():
        why = (f"pure Python (the mypyc group library {MYPYC_GROUP}__mypyc is missing: a partial build; "
               "re-run pip install -e .)")
        log.warning("hot path: %s", why)
        return why
    return None


def select() -> str:
    """Decide, once per process, whether the compiled modules or the sources run (module
    docstring); returns ``"compiled"``, the reason the sources run (``"pure Python (...)"``),
    or, called after a compiled module was imported when the sources were wanted,
    ``"compiled, though ..."`` naming those modules (with a `RuntimeWarning` saying the same).
    Entry points call it before importing anything compiled; later calls return the first answer.
    Reads ``KAPPA_PURE_PYTHON`` and the build's file times; may replace path-entry finders
    (`sys.path_importer_cache`) so that the sources are imported."""
    global _decision
    if _decision is not None:
        return _decision
    why = _why_sources()
    already = compiled_modules()
    if why is None:
        _decision = "compiled"
    elif already:  # too late to choose: the compiled modules stay, and the rest follow them
        _decision = (f"compiled, though the sources were wanted ({why.removeprefix('pure Python (')}: "
                     f"{', '.join(already)} imported compiled before hot_path.select()")
        warnings.warn(f"hot path: {_decision}", RuntimeWarning, stacklevel=2)
    else:
        _decision = why
        _use_sources()
    return _decision


def selected() -> str | None:
    """What `select` decided in this process, or None while it has not run."""
    return _decision


def compiled_modules() -> list[str]:
    """The project's modules loaded from compiled extensions in this process so far, sorted
    (empty: everything runs from source, because nothing was built or `select` chose the sources)."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] in ("router", "dispatch", "prefix_index")
                  and isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader))


def built(root: Path | None = None) -> tuple[int, bool]:
    """What the build left under ``root`` (default: this tree): how many of ``MYPYC_MODULES``
    have a compiled module, and whether every C extension has one."""
    root = ROOT if root is None else root
    mypyc = sum(_extension_of(root / m) is not None for m in MYPYC_MODULES)
    c = all(_extension_of(root / (name.replace(".", "/") + ".py")) is not None for name in C_EXTENSIONS)
    return mypyc, c


def describe() -> str:
    """One line for logs and benchmarks: what runs compiled, counted from the build (not from
    what this process imported so far), or why nothing does; a partial build says so."""
    decision = select()
    if decision != "compiled":  # the sources, or the build imported before `select` (its reason says so)
        return decision
    mypyc, c = built()
    if not mypyc and not c:
        return f"pure Python (nothing compiled was built: {_REBUILD_HINT})"
    what = f"{mypyc}/{len(MYPYC_MODULES)} mypyc modules, C block hashing {'built' if c else 'not built'}"
    if mypyc == len(MYPYC_MODULES) and c:
        return f"compiled ({what})"
    return f"partly compiled ({what}: {_REBUILD_HINT})"

