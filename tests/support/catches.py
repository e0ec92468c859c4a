"""Where a source catches exceptions, read from its AST: for the seam tests (foreign errors mapped once).

Imports none of the project's packages (STYLE.md B2).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator


def catch_sites(tree: ast.AST) -> Iterator[tuple[ast.AST, list[ast.expr]]]:
    """Each place ``tree`` catches, with the class expressions it names: an ``except`` clause's
    types, and an ``isinstance`` call's (how a context manager's ``__exit__`` catches; such a call
    may name other classes too, which the caller tells apart)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            named = node.type
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            named = node.args[1]
        else:
            continue
        yield node, list(named.elts) if isinstance(named, ast.Tuple) else [named]
