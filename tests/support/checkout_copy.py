"""A copy of this checkout in a temporary folder, and Python run in that copy alone (issue 27).

Tests use it to see what a user's tree that differs from this one does: a build that compiled only
part of the hot path, or a checkout with no ``../shared/data`` beside it. The copy holds the packages,
the tests, ``config/``, ``assets/`` (the shipped tokenizers) and the build files; compiled modules (``*.so``) only when asked.

`run_in_copy` runs a module there as ``python -m`` would, but first drops the meta-path finder of an
editable install (setuptools' ``__editable___*_finder``): on a machine where some checkout was installed
with ``pip install -e .``, that finder would find a module the copy lacks (a compiled extension it was
not given, say) in that other checkout. Imports none of our packages (tests/support rule).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ("hot_path", "gateway", "router", "prefix_index", "dispatch", "fleet_config", "mock_vllm", "sim", "tokenization",
        "config", "assets", "tests", "bench")
FILES = ("setup.py", "pyproject.toml", "README.md", "Dockerfile", "docker-compose.yml")
NOT_COPIED = ("__pycache__", ".pytest_cache", "results", "*.egg-info")
RUN_ALONE = ("import runpy, sys; "
             "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]; "
             "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def copy_checkout(dest: Path, *, compiled: bool = False) -> Path:
    """Copy this checkout's tree (`TREE`, `FILES`) to ``dest`` (created) and return it; with
    ``compiled``, its compiled modules too (file times kept, so a fresh build stays fresh)."""
    ignore = shutil.ignore_patterns(*NOT_COPIED, *(() if compiled else ("*.so",)))
    dest.mkdir(parents=True)
    for name in TREE:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in FILES:
        shutil.copy2(ROOT / name, dest / name)
    if compiled:  # the mypyc group library sits at the root, beside the packages
        for library in ROOT.glob("*.so"):
            shutil.copy2(library, dest / library.name)
    return dest


def run_in_copy(tree: Path, module: str, *args: str, env: Mapping[str, str] | None = None,
                timeout_s: float = 110.0) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with ``tree`` as its working directory and only import root (no
    editable install's finder, no ``KAPPA_PURE_PYTHON`` unless ``env`` sets it); output captured."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("KAPPA_PURE_PYTHON", "PYTHONPATH")}
    child_env |= {"PYTHONPATH": str(tree), **(env or {})}
    return subprocess.run([sys.executable, "-c", RUN_ALONE, module, *args], cwd=tree, env=child_env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
