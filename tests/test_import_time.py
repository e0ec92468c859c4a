"""Nothing runs at import: importing a package chooses no build, reads no environment and loads no
Redis client; the entry points choose the build (`hot_path.select`) and read the environment.

Checked twice: by importing the packages in a fresh interpreter, and on the source (AST) for
module-level reads of ``os.environ``/``os.getenv`` and calls of ``hot_path.select``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dependency_direction import REDIS_ALLOWED

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "router", "prefix_index", "dispatch", "fleet_config", "mock_vllm", "sim", "tokenization", "hot_path")
# The entry points that do work at import, on purpose, as their first statements: the command line
# (``kappa-gateway``, ``python -m gateway``) and the app factory's module (``uvicorn --factory
# gateway.app:create_app`` imports it before it calls the factory). See hot_path's docstring.
ENTRY_POINTS = {"gateway/commands/cli.py", "gateway/app.py"}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}

CHILD = """
import importlib, json, pkgutil, sys
import hot_path
import router, prefix_index, dispatch, fleet_config, sim, mock_vllm, tokenization
skipped = set(json.loads(sys.argv[1]))
for package in (router, prefix_index, dispatch, fleet_config, sim, mock_vllm, tokenization):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name not in skipped and not module.name.rpartition(".")[2].startswith("_"):  # not _chain
            importlib.import_module(module.name)
print(json.dumps({"decision": hot_path.selected(),
                  "redis": sorted(n for n in sys.modules if n == "redis" or n.startswith("redis."))}))
"""


def run_child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if k != "KAPPA_PURE_PYTHON"} | env
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=child_env, capture_output=True,
                          text=True, check=True, timeout=120)


def test_importing_the_libraries_chooses_no_build_and_loads_no_redis() -> None:
    redis_modules = sorted(p.removesuffix(".py").replace("/", ".") for p in REDIS_ALLOWED)
    out = json.loads(run_child(CHILD, json.dumps(redis_modules)).stdout)
    assert out == {"decision": None, "redis": []}


@pytest.mark.parametrize("entry", ["gateway.commands.cli", "gateway.app"])
def test_each_entry_point_chooses_before_anything_compiled_is_imported(entry: str) -> None:
    code = (f"import warnings; warnings.simplefilter('error'); import {entry}, hot_path; "
            "print(hot_path.selected())")
    assert run_child(code, KAPPA_PURE_PYTHON="1").stdout.strip() == "pure Python (KAPPA_PURE_PYTHON is set)"


def test_a_late_selection_that_wanted_the_sources_says_which_modules_run_compiled() -> None:
    code = """
import json, warnings
import router.cost, prefix_index.hashing, dispatch, hot_path
compiled = hot_path.compiled_modules()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    decision = hot_path.select()
print(json.dumps([compiled, decision, [str(w.message) for w in caught if w.category is RuntimeWarning]]))
"""
    compiled, decision, warned = json.loads(run_child(code, KAPPA_PURE_PYTHON="1").stdout)
    if not compiled:
        pytest.skip("nothing compiled is importable here (hot_path.built())")
    assert decision.startswith("compiled, though the sources were wanted (KAPPA_PURE_PYTHON is set)")
    assert all(name in decision for name in compiled)
    assert warned == [f"hot path: {decision}"]


def _mentions_env(node: ast.AST, env_aliases: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in ENV_NAMES and \
                isinstance(sub.value, ast.Name) and sub.value.id == "os":
            return True
        if isinstance(sub, ast.Name) and sub.id in env_aliases:
            return True
    return False


def _selects(node: ast.AST, select_aliases: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Attribute) and f.attr == "select" and isinstance(f.value, ast.Name) \
                    and f.value.id == "hot_path":
                return True
            if isinstance(f, ast.Name) and f.id in select_aliases:
                return True
    return False


def import_time_work(source: str) -> list[int]:
    """Lines where ``source`` reads the environment or calls ``hot_path.select`` when imported:
    module and class bodies, decorators, and default arguments that call something (a default
    that only names ``os.environ`` reads nothing until called); not function or lambda bodies."""
    tree = ast.parse(source)
    env_aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "os"
                   for a in n.names if a.name in ENV_NAMES}
    select_aliases = {a.asname or a.name for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and n.module == "hot_path" for a in n.names if a.name == "select"}
    found: list[int] = []

    def check(node: ast.AST) -> None:
        if _mentions_env(node, env_aliases) or _selects(node, select_aliases):
            found.append(getattr(node, "lineno", 0))

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for decorator in getattr(node, "decorator_list", []):
                check(decorator)
            for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
                if any(isinstance(sub, ast.Call) for sub in ast.walk(default)):
                    check(default)
            return  # the body runs when called
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return
        if isinstance(node, (ast.stmt, ast.expr)) and not any(isinstance(child, (ast.stmt, ast.FunctionDef,
                                                                                  ast.AsyncFunctionDef, ast.Lambda))
                                                               for child in ast.walk(node) if child is not node):
            check(node)  # a leaf statement or expression: evaluated at import
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return sorted(set(found))


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_reads_the_environment_or_selects_the_build_at_import() -> None:
    offenders = {p.relative_to(ROOT).as_posix(): lines for p in modules()
                 if (lines := import_time_work(p.read_text(encoding="utf-8")))}
    assert set(offenders) == ENTRY_POINTS, "module-level environment reads or hot_path.select() outside the entry " \
        f"points (move them to an entry point or the composition root, gateway.app / gateway.lifespan): {offenders}"


@pytest.mark.parametrize("snippet", [
    "import os\nMULTIPROCESS = 'X' in os.environ\n",
    "import os\nif os.getenv('X'):\n    pass\n",
    "from os import environ\nFLAG = environ.get('X')\n",
    "from os import getenv as ge\nFLAG = ge('X')\n",
    "import os\nclass C:\n    flag = os.environ.get('X')\n",
    "import os\ndef f(flag=os.environ.get('X')):\n    return flag\n",
    "import os\n@decorate(os.environ['X'])\ndef f():\n    pass\n",
    "import os\nVALUES = [os.environ[k] for k in ('A', 'B')]\n",
    "import hot_path\nhot_path.select()\n",
    "from hot_path import select\nselect()\n",
    "import hot_path\ntry:\n    hot_path.select()\nexcept Exception:\n    pass\n",
])
def test_the_checker_finds_import_time_work(snippet: str) -> None:
    assert import_time_work(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import os\ndef f():\n    return os.environ.get('X')\n",
    "import os\ndef f(env=os.environ):\n    return env.get('X')\n",
    "import os\nclass C:\n    def m(self):\n        return os.getenv('X')\n",
    "import os\nread = lambda: os.environ.get('X')\n",
    "import hot_path\ndef main():\n    hot_path.select()\n",
    "import os\nSEP = os.sep\n",
])
def test_the_checker_lets_work_at_call_time_pass(snippet: str) -> None:
    assert import_time_work(snippet) == [], snippet
