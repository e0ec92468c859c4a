"""Issue 14: the compiled hot path runs where it was built, the sources where asked or stale.

Child processes select the build as the entry points do (`hot_path.select` first), import the
router, the index and the pipeline as the gateway does and report which modules came from
compiled extensions (`hot_path.compiled_modules`).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hot_path

REQUIRE_COMPILED_ENV = "KAPPA_REQUIRE_COMPILED"  # .ci/run sets it where it could build the extensions
PROBE = ("import json, hot_path; hot_path.select(); "
         "import router.decide, prefix_index.hashing, prefix_index.memory_index, dispatch; "
         "import router.cost; print(json.dumps([hot_path.describe(), hot_path.compiled_modules(), router.cost.__file__]))")


def probe(**env: str) -> tuple[str, list[str], str]:
    child_env = {k: v for k, v in os.environ.items() if k != hot_path.PURE_PYTHON_ENV} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=child_env, capture_output=True, text=True, check=True,
                         cwd=hot_path.ROOT)
    described, modules, cost_file = json.loads(out.stdout)
    return described, modules, cost_file


def test_where_ci_built_it_every_listed_module_runs_compiled() -> None:
    if not os.environ.get(REQUIRE_COMPILED_ENV):
        pytest.skip(f"{REQUIRE_COMPILED_ENV} not set: this machine may have no C compiler (.ci/run sets it)")
    described, modules, cost_file = probe()
    expected = {m.removesuffix(".py").replace("/", ".") for m in hot_path.MYPYC_MODULES} | set(hot_path.C_EXTENSIONS)
    imported = expected - {"router.policies.least_loaded"}  # every module the probe imports, and more
    assert described == f"compiled ({len(hot_path.MYPYC_MODULES)}/{len(hot_path.MYPYC_MODULES)} mypyc modules, " \
        "C block hashing built)" and not cost_file.endswith(".py")
    assert imported - set(modules) == set(), f"not compiled: {sorted(imported - set(modules))}"


def test_kappa_pure_python_runs_every_module_from_its_source() -> None:
    described, modules, cost_file = probe(**{hot_path.PURE_PYTHON_ENV: "1"})
    assert modules == [] and cost_file.endswith("router/cost.py")
    assert described == "pure Python (KAPPA_PURE_PYTHON is set)"


def test_without_the_switch_the_build_decides() -> None:
    """Whatever was built runs, and `describe` says how much: all, part (a C-only build, say) or none."""
    described, modules, _ = probe(**{hot_path.PURE_PYTHON_ENV: "0"})  # "0" means not set
    mypyc, c = hot_path.built()
    assert ("router.cost" in modules) == (hot_path._extension_of(hot_path.ROOT / "router/cost.py") is not None)
    assert ("prefix_index._chain" in modules) == c
    if not mypyc and not c:
        assert described.startswith("pure Python")
    elif mypyc == len(hot_path.MYPYC_MODULES) and c:
        assert described.startswith("compiled (")
    else:
        assert described.startswith("partly compiled (")


@pytest.mark.parametrize(("value", "pure"), [("", False), ("0", False), ("1", True), ("yes", True)])
def test_the_switch_reads_set_and_not_zero(value: str, pure: bool) -> None:
    assert hot_path.pure_python_requested({hot_path.PURE_PYTHON_ENV: value}) is pure
    assert hot_path.pure_python_requested({}) is False


def test_a_compiled_module_older_than_its_source_is_stale(tmp_path: Path) -> None:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for module in ("router/cost", "router/kappa", "prefix_index/_chain"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / (module + suffix)).write_bytes(b"")
    (tmp_path / "router/cost.py").write_text("")
    (tmp_path / "router/kappa.py").write_text("")
    (tmp_path / "prefix_index/_chain.c").write_text("")
    old, new = 1_000_000_000, 1_000_000_100
    os.utime(tmp_path / "router/cost.py", (old, old))  # source older than its build: fresh
    os.utime(tmp_path / ("router/cost" + suffix), (new, new))
    os.utime(tmp_path / ("router/kappa" + suffix), (old, old))  # build older than its source: stale
    os.utime(tmp_path / "router/kappa.py", (new, new))
    os.utime(tmp_path / ("prefix_index/_chain" + suffix), (old, old))  # the C source edited since
    os.utime(tmp_path / "prefix_index/_chain.c", (new, new))
    assert hot_path.stale_modules(tmp_path) == ["router/kappa", "prefix_index/_chain"]
    assert hot_path.built(tmp_path) == (2, True)  # router/cost and router/kappa of the 17, and the C extension


def test_a_partial_build_is_described_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / "prefix_index").mkdir()
    (tmp_path / ("prefix_index/_chain" + suffix)).write_bytes(b"")  # the C extension alone: mypyc failed
    monkeypatch.setattr(hot_path, "ROOT", tmp_path)
    monkeypatch.setattr(hot_path, "_decision", "compiled")
    assert hot_path.describe() == (f"partly compiled (0/{len(hot_path.MYPYC_MODULES)} mypyc modules, C block hashing "
                                   "built: the build needs gcc, libc6-dev, libxxhash-dev and Python's headers, then "
                                   "pip install -e . again; pip install -v -e . says what it lacked)")


def test_a_rebuild_that_kept_a_modules_shim_is_not_stale(tmp_path: Path) -> None:
    """mypyc puts the code in the group's library and copies a module's shim only when it changed:
    after an edit and an in-place rebuild the shim is older than the source, the library newer. The
    module counts as built at the later of the two (a stale verdict here ran a fresh build as pure Python)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / "router").mkdir()
    (tmp_path / ("router/cost" + suffix)).write_bytes(b"")
    (tmp_path / "router/cost.py").write_text("")
    old, mid, new = 1_000_000_000, 1_000_000_050, 1_000_000_100
    os.utime(tmp_path / ("router/cost" + suffix), (old, old))
    os.utime(tmp_path / "router/cost.py", (mid, mid))
    assert hot_path.stale_modules(tmp_path) == ["router/cost"]  # no library: the shim's time decides
    library = tmp_path / f"{hot_path.MYPYC_GROUP}__mypyc{suffix}"
    library.write_bytes(b"")
    os.utime(library, (new, new))
    assert hot_path.stale_modules(tmp_path) == []
    os.utime(tmp_path / "router/cost.py", (new + 1, new + 1))  # edited after the rebuild
    assert hot_path.stale_modules(tmp_path) == ["router/cost"]
