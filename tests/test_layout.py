"""Module and function sizes stay readable (STYLE.md B3; issue 24): no module of ours over 400 lines,
at most 3 functions over 60 lines, tests excluded."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("hot_path", "gateway", "router", "prefix_index", "dispatch", "fleet_config", "mock_vllm", "sim", "tokenization",
         "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 3


def sources() -> list[Path]:
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py"))


def long_functions(path: Path, root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name (lines)`` (path relative to ``root``) of every function or method over ``limit`` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit]


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sources()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concept): {long}"


def test_at_most_three_functions_over_60_lines() -> None:
    found = [f for p in sources() for f in long_functions(p)]
    assert len(found) <= MAX_LONG_FUNCTIONS, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_function_checker_sees_a_long_one(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n" + "    x = 1\n" * 60 + "\n\ndef g():\n    return 1\n")
    assert long_functions(bad, root=tmp_path) == ["bad.py:f (61)"]
