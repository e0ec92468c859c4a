"""Redis errors are translated in one module of prefix_index/, and gateway/ imports no redis (AST).

The seam (`prefix_index.redis_errors.map_redis_errors`) turns redis-py's exceptions into
`prefix_index.errors.IndexUnavailable`; every other module catches that. A second ``except
RedisError`` anywhere would be a second mapping to keep in step.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.catches import catch_sites

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
    """Lines of the ``except`` clauses, and of the ``isinstance`` calls (how a context manager's
    ``__exit__`` catches), that name something imported from redis."""
    tree = ast.parse(source)
    names = redis_names(tree)
    lines = []
    for node, caught in catch_sites(tree):
        if isinstance(node, ast.Call):  # an isinstance of a client class (RedisCluster) is no catch
            caught = [c for c in caught if _is_error_name(c)]
        if any(root_name(c) in names for c in caught):
            lines.append(node.lineno)
    return lines


def _is_error_name(node: ast.expr) -> bool:
    """``X.FooError`` / ``FooError`` / ``...Exception``: an exception class by redis-py's naming."""
    last = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return last.endswith(("Error", "Exception"))


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
        "from redis.exceptions import ConnectionError as GoneError\n"
        "async def f(c):\n"
        "    try:\n"
        "        await c.ping()\n"
        "    except (GoneError, OSError):\n"
        "        pass\n"
        "    except r.RedisError:\n"
        "        pass\n"
        "    except ValueError:\n"
        "        pass\n"
        "def __exit__(self, t, exc, tb):\n"
        "    return isinstance(exc, (GoneError, OSError)) or isinstance(c, r.RedisCluster)\n",
        encoding="utf-8")
    assert redis_excepts(bad.read_text(encoding="utf-8")) == [6, 8, 13]
    assert imports_redis(bad.read_text(encoding="utf-8"))
    assert redis_excepts("try:\n    pass\nexcept OSError:\n    pass\n") == []
    assert not imports_redis("import redisx\nfrom prefix_index.redis_connect import RedisClient\n")
