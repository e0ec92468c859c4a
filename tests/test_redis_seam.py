"""Redis errors are translated in one module of prefix_index/, and gateway/ imports no redis (AST).

The seam (`prefix_index.redis_errors.map_redis_errors`) turns redis-py's exceptions into
`prefix_index.errors.IndexUnavailable`; every other module catches that. A second ``except
RedisError`` anywhere would be a second mapping to keep in step.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEAM = "prefix_index/redis_errors.py"
CHECKED = ("prefix_index", "gateway", "dispatch", "router")


def redis_names(tree: ast.Module) -> set[str]:
    """Local names bound to redis or anything imported from it (``import redis.asyncio as r``,
    ``from redis.exceptions import RedisError as E``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "redis":
                    names.add(alias.asname or "redis")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "redis":
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def root_name(node: ast.expr) -> str | None:
    """``a`` of ``a``, ``a.b.c``; None for anything else."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def redis_excepts(source: str) -> list[int]:
    """Lines of the ``except`` clauses that name something imported from redis."""
    tree = ast.parse(source)
    names = redis_names(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if any(root_name(c) in names for c in caught):
                lines.append(node.lineno)
    return lines


def imports_redis(source: str) -> bool:
    return bool(redis_names(ast.parse(source)))


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_redis_errors_are_caught_in_the_seam_only() -> None:
    catching = {p.relative_to(ROOT).as_posix(): lines for package in CHECKED for p in sources(package)
                if (lines := redis_excepts(p.read_text(encoding="utf-8")))}
    assert list(catching) == [SEAM], f"redis exceptions caught outside {SEAM}: {catching}"


def test_gateway_imports_no_redis() -> None:
    importing = [p.relative_to(ROOT).as_posix() for p in sources("gateway")
                 if imports_redis(p.read_text(encoding="utf-8"))]
    assert not importing, f"gateway/ imports redis (take the client and its errors from prefix_index): {importing}"


def test_the_checker_sees_a_redis_except_and_an_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import redis.asyncio as r\n"
        "from redis.exceptions import ConnectionError as Gone\n"
        "async def f(c):\n"
        "    try:\n"
        "        await c.ping()\n"
        "    except (Gone, OSError):\n"
        "        pass\n"
        "    except r.RedisError:\n"
        "        pass\n"
        "    except ValueError:\n"
        "        pass\n",
        encoding="utf-8")
    assert redis_excepts(bad.read_text(encoding="utf-8")) == [6, 8]
    assert imports_redis(bad.read_text(encoding="utf-8"))
    assert redis_excepts("try:\n    pass\nexcept OSError:\n    pass\n") == []
    assert not imports_redis("import redisx\nfrom prefix_index.redis_connect import RedisClient\n")
