"""Issue 27, item 4: the build says what it built.

* The README's set-up, the Dockerfile and .ci/run name the same system packages for the compiled
  path (`hot_path.BUILD_PACKAGES`).
* A build that leaves part of the hot path out warns at its end, and the warning reaches the
  terminal though the build's own output is captured, as a non-verbose ``pip install`` captures
  it: the build runs here under a pseudo-terminal of its own with stdout and stderr sent to a file.
* The C header probe really compiles: it finds xxhash.h where it is, and not where it is shadowed.

The image's check that fails a partial build: tests/test_build_check.py.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import select
import shlex
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import ModuleType

import pytest

import hot_path
from tests.deployment_support import ROOT, instruction_args
from tests.support.checkout_copy import copy_checkout

WARNING = "kappa-gateway build: WARNING: the compiled hot path is incomplete"


def setup_module_of(root: Path = ROOT) -> ModuleType:
    """setup.py imported, not run: its ``setup()`` call is under ``__main__``."""
    spec = importlib.util.spec_from_file_location("kappa_setup", root / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def apt_packages(command: str) -> set[str]:
    """The package names of the ``apt-get install`` commands in ``command`` (options dropped)."""
    found: set[str] = set()
    for match in re.finditer(r"apt-get install((?: [\w.+$:-]+)+)", command):
        found |= {word for word in match.group(1).split() if not word.startswith("-")}
    return found


# --- the system packages -------------------------------------------------------------------------

def test_the_readme_set_up_names_the_system_packages_of_the_compiled_path() -> None:
    set_up = readme_section("Set up and run")
    assert set(hot_path.BUILD_PACKAGES) <= apt_packages(set_up), \
        f"the set-up's apt-get install lines lack {sorted(set(hot_path.BUILD_PACKAGES) - apt_packages(set_up))}"
    assert "kappa-gateway hot-path" in set_up


def test_the_dockerfile_and_ci_install_exactly_the_build_packages() -> None:
    build_runs = [args for args in instruction_args("RUN") if re.search(r"\bpip install\b.*-e \.", args)]
    assert build_runs, "no RUN installs the tree"
    assert apt_packages(build_runs[-1]) == set(hot_path.BUILD_PACKAGES)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    listed = re.search(r'^\s*pkgs="([^"]+)"', ci, re.MULTILINE)
    assert listed and set(listed.group(1).split()) == set(hot_path.BUILD_PACKAGES), listed


# --- the warning at the end of a partial build ---------------------------------------------------

def build_under_a_terminal(tree: Path, command: str, env: dict[str, str]) -> tuple[str, str]:
    """Run ``command`` (shell) in ``tree`` as pip runs a build backend — stdin not a terminal,
    stdout and stderr captured (to a file here) — but in a session whose controlling terminal is
    a fresh pseudo-terminal. Returns (what reached the terminal, what was captured)."""
    master, slave = os.openpty()
    log = tree / "build.log"

    def take_the_terminal() -> None:  # runs in the child, after setsid: the pty becomes its terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    seen = b""
    # The shell sends its stdin, stdout and stderr elsewhere, so the child holds no descriptor of the
    # terminal (only the session's tie to it): this end stays open here until the child has ended,
    # or the terminal would hang up before the build opens /dev/tty.
    with subprocess.Popen(["sh", "-c", f"exec {command} </dev/null >{shlex.quote(str(log))} 2>&1"], cwd=tree,
                          env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                          preexec_fn=take_the_terminal) as child:
        deadline = time.monotonic() + 100.0
        while child.poll() is None or select.select([master], [], [], 0)[0]:
            assert time.monotonic() < deadline, "the build did not end in 100 s"
            if select.select([master], [], [], 0.1)[0]:
                seen += os.read(master, 4096)
        assert child.returncode == 0, log.read_text(encoding="utf-8")[-3000:]
    os.close(slave)
    os.close(master)
    return seen.decode("utf-8", "replace").replace("\r\n", "\n"), log.read_text(encoding="utf-8")


def build_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KAPPA_PURE_PYTHON", "PYTHONPATH")}
    return env | extra


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return copy_checkout(tmp_path / "checkout")


def test_a_build_without_a_compiler_warns_on_the_terminal_though_its_output_is_captured(tree: Path) -> None:
    """``CC=false``: no C compiler works, so nothing is compiled and build_ext never runs; the
    warning comes at the end of build_py, on the terminal and in the captured output."""
    terminal, captured = build_under_a_terminal(
        tree, f"{shlex.quote(sys.executable)} setup.py build --build-base {shlex.quote(str(tree / 'out'))}",
        build_env(CC="false"))
    assert WARNING in terminal and "no working C compiler" in terminal
    assert f"apt-get install {' '.join(hot_path.BUILD_PACKAGES)}" in terminal
    assert "running build_py" in captured and "running build_py" not in terminal  # only the warning: not pip's -v
    assert WARNING in captured


def test_a_build_without_xxhash_h_or_mypyc_names_both_and_the_package(tree: Path) -> None:
    """A compiler that works, an ``xxhash.h`` that does not compile (a shadowing header that stops
    with #error, found first through CFLAGS' -I) and no mypyc (a stand-in package that fails to
    import): the build installs pure Python and says, on the terminal, what it left out and why."""
    shadow = tree / "shadow"
    (shadow / "mypyc").mkdir(parents=True)
    (shadow / "xxhash.h").write_text('#error "no libxxhash-dev (this test shadows xxhash.h)"\n')
    (shadow / "mypyc" / "__init__.py").write_text('raise ImportError("no mypyc (this test hides it)")\n')
    if setup_module_of().c_compiler_works() is not None:
        pytest.skip("no working C compiler here: the xxhash.h probe cannot run")
    terminal, _ = build_under_a_terminal(
        tree, f"{shlex.quote(sys.executable)} setup.py build --build-base {shlex.quote(str(tree / 'out'))}",
        build_env(CFLAGS=f"-I{shadow}", PYTHONPATH=str(shadow)))
    assert WARNING in terminal
    assert "  - prefix_index._chain (C block hashing): xxhash.h (xxHash >= 0.8.0) not found, or too old: " \
           "apt-get install libxxhash-dev\n" in terminal
    assert re.search(rf"the {len(hot_path.MYPYC_MODULES)} mypyc modules .*: mypyc unavailable: no mypyc", terminal)


def test_a_build_asked_for_pure_python_gives_no_warning(tree: Path) -> None:
    terminal, captured = build_under_a_terminal(
        tree, f"{shlex.quote(sys.executable)} setup.py build --build-base {shlex.quote(str(tree / 'out'))}",
        build_env(KAPPA_PURE_PYTHON="1"))
    assert "KAPPA_PURE_PYTHON is set: nothing compiled" in captured
    assert WARNING not in captured and terminal == ""


def test_an_extension_that_fails_to_compile_is_named_in_build_exts_warning(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The other place the warning comes from: build_ext, after it ran and one extension failed."""
    setup = setup_module_of()
    if setup.c_compiler_works() is not None:
        pytest.skip("no working C compiler here")
    from setuptools import Distribution, Extension

    broken = tmp_path / "broken.c"
    broken.write_text('#error "does not compile"\n')
    terminal = tmp_path / "terminal"
    monkeypatch.setattr(setup, "TERMINAL", str(terminal))
    dist = Distribution({"name": "probe", "ext_modules": [Extension("broken", [str(broken)])],
                         "cmdclass": {"build_ext": setup.OptionalBuildExt}})
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    dist.run_command("build_ext")
    assert [what for what, _ in setup.LEFT_OUT] == ["broken"]
    written = terminal.read_text(encoding="utf-8")
    assert WARNING in written and "  - broken: CompileError" in written


# --- the header probe ----------------------------------------------------------------------------

def test_the_xxhash_probe_compiles_the_header_where_it_is_and_not_where_it_is_shadowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = setup_module_of()
    if setup.c_compiler_works() is not None:
        pytest.skip("no working C compiler here")
    if not Path("/usr/include/xxhash.h").is_file():
        pytest.skip("xxhash.h is not installed here (apt-get install libxxhash-dev)")
    assert setup.xxhash_missing() is None
    (tmp_path / "xxhash.h").write_text("/* an xxhash.h without XXH3: xxHash before 0.8 */\n")
    monkeypatch.setenv("CFLAGS", f"-I{tmp_path}")
    why = setup.xxhash_missing()
    assert why is not None and why.endswith("apt-get install libxxhash-dev")
