"""Issue 27, item 4: the image's build fails on a partial hot path.

No Docker engine runs here, so the Dockerfile's check is taken from the Dockerfile itself (the
last command of the RUN that installs the tree), parsed with the real CLI, and run as the image
would run it on copies of this checkout built in part: nothing compiled, the C block hashing alone
(compiled here with the system's xxhash.h), and — where this checkout has a full build — that build
without the mypyc group library (the shims left, their code gone: what an image once shipped). On
the full build itself it passes, so it is not a check that always fails.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hot_path
from tests.deployment_support import instruction_args, parse_cli
from tests.support.checkout_copy import copy_checkout, run_in_copy

FAILED = "error: --require-compiled: the build is not fully compiled"


def dockerfile_check() -> list[str]:
    """The command the Dockerfile runs right after installing the tree, as argv."""
    installs = [args for args in instruction_args("RUN") if re.search(r"\bpip install\b.*(?:-e|--editable) \.", args)]
    assert installs, "no RUN installs the tree"
    return shlex.split(installs[-1].split("&&")[-1])


def run_check(tree: Path) -> subprocess.CompletedProcess[str]:
    argv = dockerfile_check()
    assert argv[0] == "kappa-gateway"
    return run_in_copy(tree, "gateway", *argv[1:])  # python -m gateway is the console script's app


def full_build_here() -> bool:
    return hot_path.built() == (len(hot_path.MYPYC_MODULES), True) and not hot_path.stale_modules()


def test_the_dockerfile_ends_its_install_with_the_require_compiled_check() -> None:
    assert parse_cli(dockerfile_check()) == ("hot-path", {"require_compiled": True})


def test_the_check_fails_a_tree_with_nothing_compiled(tmp_path: Path) -> None:
    result = run_check(copy_checkout(tmp_path / "checkout"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hot path: pure Python (nothing compiled was built" in result.stdout
    assert f"{len(hot_path.MYPYC_MODULES) + len(hot_path.C_EXTENSIONS)} of " in result.stdout
    assert FAILED in result.stderr and "libxxhash-dev" in result.stderr


def test_the_check_fails_a_tree_with_only_the_c_block_hashing(tmp_path: Path) -> None:
    if shutil.which("cc") is None or not Path("/usr/include/xxhash.h").is_file():
        pytest.skip("no C compiler or xxhash.h here (apt-get install gcc libc6-dev libxxhash-dev)")
    tree = copy_checkout(tmp_path / "checkout")
    build = subprocess.run(
        [sys.executable, "-c", "from setuptools import Extension, setup; setup(name='chain', script_args=["
         "'build_ext', '--inplace'], ext_modules=[Extension('_chain', ['_chain.c'], extra_compile_args=['-O1'])])"],
        cwd=tree / "prefix_index", capture_output=True, text=True, check=False, timeout=100)
    assert build.returncode == 0, build.stderr[-2000:]
    result = run_check(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"partly compiled (0/{len(hot_path.MYPYC_MODULES)} mypyc modules, C block hashing built" in result.stdout
    assert "prefix_index._chain" not in result.stdout.split("run as Python:")[1]
    assert FAILED in result.stderr


def test_the_check_fails_a_build_whose_mypyc_group_library_is_missing(tmp_path: Path) -> None:
    if not full_build_here():
        pytest.skip("this checkout has no fresh full build (pip install -e . with the build packages: .ci/run)")
    tree = copy_checkout(tmp_path / "checkout", compiled=True)
    libraries = list(tree.glob(f"{hot_path.MYPYC_GROUP}__mypyc*.so"))
    assert libraries, "a full build without its group library"
    for library in libraries:
        library.unlink()
    result = run_check(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the mypyc group library {hot_path.MYPYC_GROUP}__mypyc is missing" in result.stdout
    assert FAILED in result.stderr


def test_the_check_passes_the_full_build(tmp_path: Path) -> None:
    if not full_build_here():
        pytest.skip("this checkout has no fresh full build (pip install -e . with the build packages: .ci/run)")
    result = run_check(copy_checkout(tmp_path / "checkout", compiled=True))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == (f"hot path: compiled ({len(hot_path.MYPYC_MODULES)}/{len(hot_path.MYPYC_MODULES)} "
                                     "mypyc modules, C block hashing built)")


def test_without_the_flag_the_command_reports_and_succeeds(tmp_path: Path) -> None:
    result = run_in_copy(copy_checkout(tmp_path / "checkout"), "gateway", "hot-path")
    assert result.returncode == 0 and result.stdout.startswith("hot path: pure Python"), result.stderr
    assert "error:" not in result.stderr
