"""Reads the model and hardware catalogs (``config/models.yaml``, ``config/hardware.yaml``).

The router reads no files (DESIGN.md §2): `router.profiles.Catalog` is built here from the
parsed mappings, when asked (`default_catalog` reads the shipped files once per process, not at
import), and handed to whoever needs it (the gateway, the mock backends, the simulator).
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

from router.profiles import Catalog

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def load_catalog(config_dir: Path = CONFIG_DIR) -> Catalog:
    """Parse ``models.yaml`` and ``hardware.yaml`` in ``config_dir`` into a `Catalog`.

    Raises:
        FileNotFoundError: a catalog file is missing.
        router.errors.ProfileError: an entry is invalid (the message names its path).
    """
    models_doc = yaml.safe_load((config_dir / "models.yaml").read_text(encoding="utf-8"))
    hardware_doc = yaml.safe_load((config_dir / "hardware.yaml").read_text(encoding="utf-8"))
    return Catalog.from_mappings(models_doc, hardware_doc)


@functools.cache
def default_catalog() -> Catalog:
    """The catalog shipped in ``config/``, read once per process."""
    return load_catalog()
