"""aiohttp's errors are mapped to the gateway's in one module, the upstream seam (issue 24).

`gateway.upstream.errors.mapped_errors` is the only place of the edge that names an aiohttp
exception class in an ``except`` clause; the relay, the attempts and the health checks catch
the gateway's own errors (`gateway.errors`). The command room (gateway/commands/) is a set of
tools with aiohttp clients of their own and is not checked. Checked on the source (AST).
"""

from __future__ import annotations

import ast
from pathlib import Path

import aiohttp
import pytest

from gateway.errors import UpstreamReset, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.errors import Phase, mapped_errors
from tests.support.catches import catch_sites

ROOT = Path(__file__).resolve().parents[1]
SEAM = "gateway/upstream/errors.py"
NOT_CHECKED = ("gateway/commands/",)


def aiohttp_names_caught(source: str) -> list[str]:
    """The aiohttp exception classes named in the ``except`` clauses of ``source``, and in its
    ``isinstance`` calls (how a context manager's ``__exit__`` catches), in order.

    Recognises ``aiohttp.X`` (any alias of ``import aiohttp``, also ``aiohttp.sub.X``) and
    names imported with ``from aiohttp[.sub] import X [as Y]``.
    """
    tree = ast.parse(source)
    module_aliases: set[str] = set()
    imported: dict[str, str] = {}  # local name -> aiohttp class name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aiohttp":
                    module_aliases.add(alias.asname or "aiohttp")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "aiohttp":
            for alias in node.names:
                imported[alias.asname or alias.name] = alias.name

    def root_name(expr: ast.expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    caught: list[str] = []
    for _, types in catch_sites(tree):
        for t in types:
            if isinstance(t, ast.Attribute) and root_name(t) in module_aliases:
                caught.append(t.attr)
            elif isinstance(t, ast.Name) and t.id in imported:
                caught.append(imported[t.id])
    return caught


def modules_catching_aiohttp() -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_CHECKED):
            continue
        names = aiohttp_names_caught(path.read_text(encoding="utf-8"))
        if names:
            found[rel] = names
    return found


def test_only_the_seam_catches_aiohttp_errors() -> None:
    found = modules_catching_aiohttp()
    assert list(found) == [SEAM], f"aiohttp errors caught outside {SEAM} (use mapped_errors): {found}"


def test_the_checker_sees_every_spelling() -> None:
    """The check can fail: each way of naming an aiohttp error in an ``except`` is caught."""
    bad = """
import aiohttp
import aiohttp as ah
from aiohttp import ClientPayloadError
from aiohttp.client_exceptions import ServerDisconnectedError as Gone
try:
    pass
except (aiohttp.ClientError, TimeoutError):
    pass
except ah.client_exceptions.ClientOSError:
    pass
except ClientPayloadError:
    pass
except Gone:
    pass
def __exit__(self, exc_type, exc, tb):
    return isinstance(exc, (aiohttp.ClientConnectorError, Gone))
"""
    assert sorted(aiohttp_names_caught(bad)) == sorted(["ClientError", "ClientOSError", "ClientPayloadError",
                                                        "ServerDisconnectedError", "ClientConnectorError",
                                                        "ServerDisconnectedError"])


def test_the_checker_ignores_other_errors() -> None:
    fine = """
import aiohttp
from gateway.errors import UpstreamError
try:
    pass
except (UpstreamError, TimeoutError, ValueError):
    pass
except Exception:
    pass
except:
    pass
"""
    assert aiohttp_names_caught(fine) == []


def _raise_in(phase: Phase, exc: BaseException) -> BaseException:
    with pytest.raises(BaseException) as caught:
        with mapped_errors(phase, "b1"):
            raise exc
    return caught.value


_REFUSED = aiohttp.ClientConnectorError(
    aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 9, False, True, None, None, None),
    ConnectionRefusedError(111, "Connection refused"))

# (phase, aiohttp error, gateway error type, its message, or None to check the type only)
CASES = [
    (Phase.OPENING, _REFUSED, UpstreamUnavailable, None),
    (Phase.OPENING, aiohttp.ConnectionTimeoutError("connect"), UpstreamUnavailable,
     "backend unreachable: ConnectionTimeoutError: connect"),
    (Phase.OPENING, aiohttp.ServerDisconnectedError(), UpstreamReset,
     "backend closed the connection before the first byte: ServerDisconnectedError"),
    (Phase.OPENING, aiohttp.SocketTimeoutError("read"), UpstreamReset,
     "backend closed the connection before the first byte: SocketTimeoutError"),
    (Phase.STREAM, aiohttp.ClientPayloadError("cut"), UpstreamReset, "backend b1 failed mid-stream: ClientPayloadError"),
    (Phase.STREAM, aiohttp.SocketTimeoutError("read"), UpstreamTimeout, None),
    (Phase.BODY, aiohttp.ServerDisconnectedError(), UpstreamReset,
     "backend b1 failed while sending its response: ServerDisconnectedError"),
    (Phase.BODY, aiohttp.SocketTimeoutError("read"), UpstreamTimeout, None),
    (Phase.PROBE, _REFUSED, UpstreamUnavailable, None),
    (Phase.PROBE, aiohttp.ClientPayloadError("cut"), UpstreamReset, "backend probe failed: ClientPayloadError: cut"),
]


@pytest.mark.parametrize(("phase", "exc", "mapped", "message"), CASES,
                         ids=[f"{p.value}-{type(e).__name__}" for p, e, _, _ in CASES])
def test_each_phase_maps_aiohttp_errors(phase: Phase, exc: Exception, mapped: type[Exception],
                                        message: str | None) -> None:
    out = _raise_in(phase, exc)
    assert type(out) is mapped
    assert out.__cause__ is exc
    if message is not None:
        assert str(out) == message
    if isinstance(out, UpstreamTimeout):
        assert out.eject  # silent past a read timeout after the first byte: the backend hung


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("exc", [TimeoutError(), ValueError("bad"), ConnectionResetError()])
def test_other_errors_pass_unchanged(phase: Phase, exc: Exception) -> None:
    """The asyncio timeouts' TimeoutError keeps its caller's bound and message; non-aiohttp errors pass."""
    assert _raise_in(phase, exc) is exc
