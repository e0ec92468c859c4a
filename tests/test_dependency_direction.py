"""DESIGN.md §2: who may import whom, checked on the source's import statements (AST)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"gateway", "router", "prefix_index", "mock_vllm", "sim", "bench", "tests"}

# package -> top-level modules it must never import (ours and foreign I/O libraries).
FORBIDDEN = {
    "router": OURS - {"router"} | {"asyncio", "redis", "httpx", "aiohttp", "fastapi", "starlette",
                                    "prometheus_client", "uvicorn", "socket", "subprocess", "xxhash"},
    "prefix_index": {"gateway", "router", "mock_vllm", "sim", "bench", "tests", "httpx", "fastapi"},
    "mock_vllm": {"gateway", "prefix_index", "sim", "bench", "tests"},
    "sim": {"gateway", "bench", "tests"},
    "tests/support": OURS - {"tests"},
}
# Only the Redis implementation's modules of prefix_index may import redis.
REDIS_ALLOWED = {"prefix_index/redis_index.py", "prefix_index/redis_batch.py"}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", list(FORBIDDEN), ids=list(FORBIDDEN))
def test_package_imports_only_what_design_allows(package: str) -> None:
    violations = []
    for path in python_files(package):
        rel = path.relative_to(ROOT).as_posix()
        forbidden = FORBIDDEN[package]
        if package == "prefix_index" and rel not in REDIS_ALLOWED:
            forbidden = forbidden | {"redis"}
        bad = imported_top_levels(path) & forbidden
        if bad:
            violations.append(f"{rel} imports {sorted(bad)}")
    assert not violations, "DESIGN.md §2 dependency direction broken:\n" + "\n".join(violations)


def test_prefix_index_imports_only_stdlib_and_xxhash() -> None:
    """STYLE.md B2 as an allow-list: stdlib, xxhash; redis only in the Redis implementation's modules."""
    allowed = set(sys.stdlib_module_names) | {"xxhash", "prefix_index"}
    violations = []
    for path in python_files("prefix_index"):
        rel = path.relative_to(ROOT).as_posix()
        extra = imported_top_levels(path) - allowed - ({"redis"} if rel in REDIS_ALLOWED else set())
        if extra:
            violations.append(f"{rel} imports {sorted(extra)}")
    assert not violations, "\n".join(violations)


def test_router_reads_no_clock() -> None:
    clock_calls = []
    for path in python_files("router"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "time"
                    and node.attr in {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"}):
                clock_calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not clock_calls, f"router/ reads the clock (pass now_s in): {clock_calls}"


def test_checker_sees_a_violation(tmp_path: Path) -> None:
    """The check itself can fail: a file importing gateway is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from gateway.app import create_app\nimport redis.asyncio\n")
    assert imported_top_levels(bad) == {"gateway", "redis"}
