"""Build kappa-gateway: the per-request hot path compiled where it can be, pure Python where not.

Everything else is in pyproject.toml. What is compiled, and when the sources run instead, is
`hot_path` (issue 14): mypyc compiles ``hot_path.MYPYC_MODULES`` from their own ``.py`` files,
and ``prefix_index._chain`` is the chained block hashing in C (with the system's header-only
xxHash, Debian's ``libxxhash-dev``).

Nothing here is required to install: with ``KAPPA_PURE_PYTHON=1``, or without mypy, a C
compiler or ``xxhash.h``, the build says why on stderr and installs the pure-Python package,
which gives the same results (tests run both ways in CI: .ci/run).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # hot_path, from this tree (it imports nothing of the project)

import hot_path  # noqa: E402


def note(message: str) -> None:
    print(f"kappa-gateway build: {message}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that installs the sources when an extension cannot be compiled (the modules
    fall back to their ``.py``: `hot_path`)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 — no compiler, a failed compile: pure Python, said once
            note(f"compiled hot path not built ({type(exc).__name__}: {exc}); installing pure Python")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            note(f"{ext.name} not built ({type(exc).__name__}: {exc}); its Python source runs instead")


def c_compiler_works() -> str | None:
    """None if the build's C compiler compiles a trivial file, else why not (checked before
    mypyc spends a minute type-checking for a compile that cannot happen)."""
    try:
        from distutils.ccompiler import new_compiler
        from distutils.sysconfig import customize_compiler

        compiler = new_compiler()
        customize_compiler(compiler)
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "probe.c"
            source.write_text("int main(void) { return 0; }\n")
            compiler.compile([str(source)], output_dir=tmp)
    except Exception as exc:  # noqa: BLE001 — no compiler, or it fails: said, then pure Python
        return f"{type(exc).__name__}: {exc}"
    return None


def extensions() -> list[Extension]:
    if hot_path.pure_python_requested():
        note(f"{hot_path.PURE_PYTHON_ENV} is set: nothing compiled")
        return []
    no_compiler = c_compiler_works()
    if no_compiler is not None:
        note(f"no working C compiler ({no_compiler}): installing pure Python")
        return []
    out: list[Extension] = []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        note(f"mypyc unavailable ({exc}): the κ model and router stay pure Python")
    else:
        try:
            out += mypycify(list(hot_path.MYPYC_MODULES), opt_level="3", group_name=hot_path.MYPYC_GROUP)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 — mypy failed on a module (it exits): pure Python, said
            note(f"mypyc failed ({type(exc).__name__}: {exc}): the κ model and router stay pure Python")
    for name, sources in hot_path.C_EXTENSIONS.items():
        out.append(Extension(name, list(sources), extra_compile_args=["-O3"]))
    return out


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
