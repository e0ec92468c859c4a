"""Build kappa-gateway: the per-request hot path compiled where it can be, pure Python where not.

Everything else is in pyproject.toml. What is compiled, and when the sources run instead, is
`hot_path` (issue 14): mypyc compiles ``hot_path.MYPYC_MODULES`` from their own ``.py`` files,
and ``prefix_index._chain`` is the chained block hashing in C (with the system's header-only
xxHash, Debian's ``libxxhash-dev``).

Nothing here is required to install: with ``KAPPA_PURE_PYTHON=1``, or without mypy, a C
compiler, Python's headers or ``xxhash.h``, the build installs the pure-Python package, which
gives the same results (tests run both ways in CI: .ci/run). A build that leaves out what it
was not asked to leave out says so, at the end, in a warning naming what it lacked and
``hot_path.BUILD_PACKAGES`` (issue 27). pip captures a build's output and shows it only with
``-v`` (its ``call_subprocess`` pipes the backend's stdout and stderr), so the warning goes to
stderr and also to the terminal pip runs in (``/dev/tty``, pip's controlling terminal, which
its build subprocess inherits); where there is none (CI, ``docker build``) stderr is all, and
the Dockerfile checks the build itself (``kappa-gateway hot-path --require-compiled``).
"""

from __future__ import annotations

import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # hot_path, from this tree (it imports nothing of the project)

import hot_path  # noqa: E402

TERMINAL = "/dev/tty"
"""The controlling terminal: what a non-verbose pip does not capture (module docstring)."""
XXHASH_PROBE = """#define XXH_INLINE_ALL
#include <xxhash.h>
#if !defined(XXH_VERSION_NUMBER) || XXH_VERSION_NUMBER < 800
#error "xxHash >= 0.8.0 needed (its XXH3 output is stable from 0.8.0 on)"
#endif
int main(void) { XXH64_hash_t h = XXH3_64bits("", 0); return (int)h; }
"""
"""A file that compiles where ``prefix_index/_chain.c`` finds the xxHash it uses: XXH3, stable since 0.8.0."""
PYTHON_H_PROBE = "#include <Python.h>\nint main(void) { return 0; }\n"

LEFT_OUT: list[tuple[str, str]] = []
"""(what this build did not compile, why), in the order found; the end-of-build warning's lines."""


def note(message: str) -> None:
    print(f"kappa-gateway build: {message}", file=sys.stderr)


def left_out(what: str, why: str) -> None:
    """Record that ``what`` is not compiled and why (said at once, and again in the warning)."""
    LEFT_OUT.append((what, why))
    note(f"{what} not built ({why})")


def partial_build_warning(missing: list[tuple[str, str]]) -> str:
    """The end-of-build warning for what was left out: what runs as Python instead, what to install."""
    lines = [f"  - {what}: {why}" for what, why in missing]
    return "\n".join([
        "", "kappa-gateway build: WARNING: the compiled hot path is incomplete; these run as pure Python "
        "(the same results, slower routing):", *lines,
        f"  To compile them: apt-get install {' '.join(hot_path.BUILD_PACKAGES)} (and python3-dev for Debian's "
        "python3), then reinstall. `kappa-gateway hot-path` says what runs.", ""])


def warn(text: str) -> None:
    """Write ``text`` to stderr and, when stderr is not a terminal (pip captures it), to `TERMINAL`
    too, if one can be opened; without one (CI, a container build) stderr is all."""
    print(text, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open(TERMINAL, "w", encoding="utf-8") as tty:
            tty.write(text + "\n")
    except OSError:  # no controlling terminal: ENXIO, or no /dev/tty at all
        pass


def warn_if_partial() -> None:
    if LEFT_OUT:
        warn(partial_build_warning(LEFT_OUT))


class OptionalBuildExt(build_ext):
    """build_ext that installs the sources when an extension cannot be compiled (the modules
    fall back to their ``.py``: `hot_path`), and warns at its end about what it left out."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 — no compiler, a failed compile: pure Python, said
            left_out("the compiled hot path", f"{type(exc).__name__}: {exc}")
        finally:
            warn_if_partial()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            left_out(ext.name, f"{type(exc).__name__}: {exc}; its Python source runs instead")


class ReportingBuildPy(build_py):
    """build_py that gives the warning when there is nothing to compile at all (build_ext does not
    run then): every build, wheel or editable, runs build_py."""

    def run(self) -> None:
        super().run()
        if not self.distribution.has_ext_modules():
            warn_if_partial()


def compile_fails(source: str, include_dirs: tuple[str, ...] = ()) -> str | None:
    """None if the build's C compiler (``CC``, ``CFLAGS`` honoured) compiles ``source``, else why
    not, in a line (the compiler's own diagnostics go to stderr: ``pip install -v`` shows them)."""
    try:
        from distutils.ccompiler import new_compiler
        from distutils.sysconfig import customize_compiler

        compiler = new_compiler()
        customize_compiler(compiler)
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp) / "probe.c"
            probe.write_text(source)
            compiler.compile([str(probe)], output_dir=tmp, include_dirs=list(include_dirs))
    except Exception as exc:  # noqa: BLE001 — no compiler, or it fails: said, then pure Python
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first[:160]}{'...' if len(first) > 160 else ''}"
    return None


def c_compiler_works() -> str | None:
    """None if a trivial C file compiles, else why not (checked before mypyc spends a minute
    type-checking for a compile that cannot happen)."""
    return compile_fails("int main(void) { return 0; }\n")


def python_headers_missing() -> str | None:
    """None if ``Python.h`` compiles, else what is missing and which package brings it."""
    if compile_fails(PYTHON_H_PROBE, (sysconfig.get_paths()["include"],)) is None:
        return None
    return "Python.h (Python's headers) does not compile: python3-dev"


def xxhash_missing() -> str | None:
    """None if ``xxhash.h`` (with XXH3) compiles, else what is missing and which package brings it."""
    if compile_fails(XXHASH_PROBE) is None:
        return None
    return "xxhash.h (xxHash >= 0.8.0) not found, or too old: apt-get install libxxhash-dev"


def extensions() -> list[Extension]:
    if hot_path.pure_python_requested():
        note(f"{hot_path.PURE_PYTHON_ENV} is set: nothing compiled")
        return []
    everything = "the compiled hot path (mypyc modules and C block hashing)"
    no_compiler = c_compiler_works()
    if no_compiler is not None:
        left_out(everything, f"no working C compiler: {no_compiler}")
        return []
    no_headers = python_headers_missing()
    if no_headers is not None:
        left_out(everything, no_headers)
        return []
    out: list[Extension] = []
    mypyc_modules = f"the {len(hot_path.MYPYC_MODULES)} mypyc modules (κ model, router, index, ledger)"
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        left_out(mypyc_modules, f"mypyc unavailable: {exc}")
    else:
        try:
            out += mypycify(list(hot_path.MYPYC_MODULES), opt_level="3", group_name=hot_path.MYPYC_GROUP)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 — mypy failed on a module (it exits): said
            left_out(mypyc_modules, f"mypyc failed: {type(exc).__name__}: {exc}")
    no_xxhash = xxhash_missing()
    for name, sources in hot_path.C_EXTENSIONS.items():
        if no_xxhash is None:
            out.append(Extension(name, list(sources), extra_compile_args=["-O3"]))
        else:
            left_out(f"{name} (C block hashing)", no_xxhash)
    return out


if __name__ == "__main__":  # as setuptools runs it (build_meta execs it as __main__); tests import it
    setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt, "build_py": ReportingBuildPy})
