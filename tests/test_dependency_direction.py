"""DESIGN.md §2: who may import whom, checked on the source's import statements (AST)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"hot_path", "gateway", "router", "prefix_index", "dispatch", "fleet_config", "mock_vllm", "sim", "tokenization",
        "bench", "tests"}
IO_LIBRARIES = {"asyncio", "redis", "httpx", "aiohttp", "fastapi", "starlette", "prometheus_client", "uvicorn",
                "socket", "subprocess"}

# Who may import whom (DESIGN.md §2, README "Architecture"):
#   hot_path      which modules run compiled (issue 14): stdlib only, below every package
#   router        the decision: stdlib and pydantic only, no I/O, no clock
#   prefix_index  canonical bytes, hashing, the index: stdlib, xxhash (redis in its Redis modules)
#   dispatch      the one pipeline (gateway and simulator): router, prefix_index; no I/O, no clock
#   fleet_config  the config schema and files: router, prefix_index (its defaults)
#   tokenization  the engines' tokenizer (issue 30): stdlib, tokenizers, jinja2 only, no room of ours, so
#                 the mock (as the engine) and the gateway (to name the engine's blocks) share one copy;
#                 prefix_index, router and dispatch stay free of it (they see token ids, not text)
#   mock_vllm     the mock backend: router, fleet_config (it is built from a backend entry), tokenization
#   sim           the simulator: router, prefix_index, dispatch, fleet_config, mock_vllm
#   gateway       the HTTP edge: router, prefix_index, dispatch, fleet_config; never sim or mock_vllm
#   gateway/commands  the CLI and offline tools: everything
# package (a folder, or a folder minus sub-folders listed on their own) -> modules it must never import.
FORBIDDEN = {
    "hot_path": OURS - {"hot_path"} | IO_LIBRARIES | {"xxhash", "pydantic"},
    "router": OURS - {"router", "hot_path"} | IO_LIBRARIES | {"xxhash"},
    "prefix_index": {"gateway", "router", "dispatch", "fleet_config", "mock_vllm", "sim", "tokenization", "bench",
                     "tests", "httpx", "fastapi"},
    "dispatch": OURS - {"dispatch", "router", "prefix_index", "hot_path"} | IO_LIBRARIES,
    "fleet_config": OURS - {"fleet_config", "router", "prefix_index", "hot_path"} | IO_LIBRARIES,
    "tokenization": OURS - {"tokenization"},
    "mock_vllm": OURS - {"mock_vllm", "router", "fleet_config", "hot_path", "tokenization"},
    "sim": {"gateway", "bench", "tests"},
    "gateway": {"sim", "mock_vllm", "bench", "tests"},
    "tests/support": OURS - {"tests"},
}
# The edge may not reach into the command room either (checked on dotted names).
EDGE_MAY_NOT_IMPORT = ("gateway.commands",)
SUB_ROOMS = {"gateway": ["gateway/commands", "gateway/__main__.py"]}  # the command room (and `python -m gateway`, its entry)
# Only the Redis implementation's modules of prefix_index may import redis.
REDIS_ALLOWED = {"prefix_index/redis_index.py", "prefix_index/redis_batch.py", "prefix_index/redis_registry.py",
                 "prefix_index/redis_connect.py", "prefix_index/redis_errors.py",
                 "prefix_index/engine_redis.py"}  # issue 30: the exact (event-fed) index in Redis
# Only the KV-event decoder may import msgpack (issue 30): vLLM's events are msgpack on the wire, and
# one module turns their bytes into our typed events (prefix_index/engine_events.py), pure, no I/O.
MSGPACK_ALLOWED = {"prefix_index/engine_events.py"}
# Rooms that read no clock: time comes in as an argument (an injected clock at most).
NO_CLOCK = ("router", "dispatch")


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
    excluded = [ROOT / sub for sub in SUB_ROOMS.get(package, [])]
    return sorted(p for p in (ROOT / package).rglob("*.py") if not any(p.is_relative_to(e) for e in excluded))


def imported_modules(path: Path) -> set[str]:
    """Dotted names of every absolute import (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", list(FORBIDDEN), ids=list(FORBIDDEN))
def test_package_imports_only_what_design_allows(package: str) -> None:
    violations = []
    for path in python_files(package):
        rel = path.relative_to(ROOT).as_posix()
        forbidden = FORBIDDEN[package]
        if package == "prefix_index" and rel not in REDIS_ALLOWED:
            forbidden = forbidden | {"redis"}
        bad = imported_top_levels(path) & forbidden
        if package == "gateway":
            bad |= {m for m in imported_modules(path) if m.startswith(EDGE_MAY_NOT_IMPORT)}
        if bad:
            violations.append(f"{rel} imports {sorted(bad)}")
    assert not violations, "DESIGN.md §2 dependency direction broken:\n" + "\n".join(violations)


def test_prefix_index_imports_only_stdlib_and_xxhash() -> None:
    """STYLE.md B2 as an allow-list: stdlib, xxhash, hot_path (which of its modules run compiled);
    redis only in the Redis implementation's modules, msgpack only in the KV-event decoder."""
    allowed = set(sys.stdlib_module_names) | {"xxhash", "prefix_index", "hot_path"}
    violations = []
    for path in python_files("prefix_index"):
        rel = path.relative_to(ROOT).as_posix()
        extra = (imported_top_levels(path) - allowed - ({"redis"} if rel in REDIS_ALLOWED else set())
                 - ({"msgpack"} if rel in MSGPACK_ALLOWED else set()))
        if extra:
            violations.append(f"{rel} imports {sorted(extra)}")
    assert not violations, "\n".join(violations)


def test_tokenization_imports_only_stdlib_tokenizers_and_jinja2() -> None:
    """The tokenizer room as an allow-list: what a vLLM engine's tokenisation needs and nothing of ours."""
    allowed = set(sys.stdlib_module_names) | {"tokenizers", "jinja2", "tokenization"}
    violations = [f"{p.relative_to(ROOT).as_posix()} imports {sorted(extra)}" for p in python_files("tokenization")
                  if (extra := imported_top_levels(p) - allowed)]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("package", NO_CLOCK)
def test_pure_rooms_read_no_clock(package: str) -> None:
    clock_calls = []
    for path in python_files(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "time"
                    and node.attr in {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"}):
                clock_calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not clock_calls, f"{package}/ reads the clock (pass now_s or a clock in): {clock_calls}"


def test_checker_sees_a_violation(tmp_path: Path) -> None:
    """The check itself can fail: a file importing gateway is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from gateway.app import create_app\nimport redis.asyncio\nfrom gateway.commands import cli\n")
    assert imported_top_levels(bad) == {"gateway", "redis"}
    assert "gateway.commands.cli" in imported_modules(bad)


# The rooms of gateway/ (ARCHITECTURE.md): a sub-package or a top-level module each, and the rooms each
# may import (function-level imports included). Read bottom up: the order is a DAG, so no two rooms
# import each other.
GATEWAY_ROOMS: dict[str, set[str]] = {
    "errors": set(),                      # the GatewayError tree and its OpenAI body
    "telemetry": set(),                   # prometheus metrics on an injected registry
    "edge": {"errors"},                   # HTTP hygiene: answers, auth, admission, body, request ids, access log
    "upstream": {"errors", "edge"},       # the aiohttp session, one attempt's request, aiohttp's errors mapped once
    "backends": {"errors", "telemetry", "upstream"},  # health, scrape, the kappa_crit feed, index truth
    "replicas": {"errors", "telemetry"},  # the load exchange between gateway replicas
    "invalidation": {"telemetry"},        # prefix invalidation live: the detector, its counters, pending findings
    "parsed": {"errors", "invalidation"},  # a body loaded, the fields routing keeps (ParsedRequest)
    "routing": {"errors", "telemetry", "backends", "invalidation", "parsed"},  # a body parsed, hashed and sent through dispatch
    "state": {"edge", "telemetry", "backends", "routing", "replicas"},  # what the lifespan opens
    "proxy": {"errors", "edge", "telemetry", "backends", "parsed", "routing", "state", "upstream"},  # handler, attempts, relay, SSE
    "routes": {"errors", "edge", "backends", "parsed", "routing", "state", "proxy"},  # the HTTP surface
    "serving": {"errors", "edge", "telemetry"},  # uvicorn, connections, the --workers supervisor
    "lifespan": {"errors", "telemetry", "edge", "backends", "replicas", "routing", "state", "proxy", "upstream"},
    "app": {"errors", "telemetry", "edge", "upstream", "backends", "replicas", "routing", "state", "proxy", "routes",
            "lifespan"},
    "commands": {"errors", "telemetry", "edge", "upstream", "backends", "replicas", "parsed", "routing", "state", "proxy",
                 "routes", "lifespan", "app", "serving"},  # the tool room: everything
    "__main__": {"commands"},
}


def gateway_room(module: str) -> str | None:
    """The room of a dotted ``gateway`` module (``gateway.proxy.relay`` -> ``proxy``), None outside gateway/."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in sorted(OURS - {"bench", "tests"}) for p in (ROOT / pkg).rglob("*.py")}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports, anywhere in the file (``from a.b import c`` names ``a.b.c``
    when that is a module, else ``a.b``); a compiled-only module (a ``.pyi`` beside its C source) is a leaf."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            if (ROOT / name.replace(".", "/")).with_suffix(".pyi").exists():
                return None
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {resolve(m) for m in imported_modules(path)} - {None, name}
        graph[name] = {d for d in deps if d is not None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    """No two modules of ours import each other, directly or around a circle (imports inside functions
    count: they hide a cycle, they do not break it)."""
    found = cycles(import_graph(our_modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_gateway_rooms_import_only_the_rooms_below_them() -> None:
    modules = our_modules()
    rooms = {gateway_room(m) for m in modules} - {None}
    assert rooms <= set(GATEWAY_ROOMS), f"rooms of gateway/ not placed in GATEWAY_ROOMS: {sorted(rooms - set(GATEWAY_ROOMS))}"
    violations = []
    for name, deps in import_graph(modules).items():
        room = gateway_room(name)
        if room is None:
            continue
        bad = {gateway_room(d) for d in deps} - {None, room} - GATEWAY_ROOMS[room]
        if bad:
            violations.append(f"{name} ({room}) imports the room(s) {sorted(b for b in bad if b)}")
    assert not violations, "gateway/ rooms out of order (ARCHITECTURE.md):\n" + "\n".join(violations)


def test_gateway_rooms_form_a_dag() -> None:
    assert not cycles({room: set(allowed) for room, allowed in GATEWAY_ROOMS.items()})


def test_the_edge_excludes_the_command_room() -> None:
    edge = {p.relative_to(ROOT).as_posix() for p in python_files("gateway")}
    assert "gateway/proxy/handler.py" in edge and not any(p.startswith("gateway/commands/") for p in edge)
