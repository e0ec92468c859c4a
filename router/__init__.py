"""The router: κ cost model, candidates and policies (pure: no I/O)."""

import importlib.machinery
import sys


def compiled_modules() -> list[str]:
    """The project modules loaded from compiled extensions (mypyc), sorted."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] in ("router", "dispatch", "prefix_index")
                  and isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader))
