"""Catalog loading: every shipped entry validates; bad entries fail with their path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fleet_config.catalog import CONFIG_DIR, load_catalog
from router.errors import ProfileError
from router.profiles import Catalog

MODELS_DOC = yaml.safe_load((CONFIG_DIR / "models.yaml").read_text())
HARDWARE_DOC = yaml.safe_load((CONFIG_DIR / "hardware.yaml").read_text())


def test_shipped_catalogs_hold_the_reference_entries_with_sources() -> None:
    catalog = load_catalog()
    assert len(catalog.models) >= 9 and len(catalog.hardware) >= 9
    for name in ("h100-sxm", "h100-pcie", "h200-sxm", "b200", "gh200", "a100-80gb", "l40s", "l4", "mi300x"):
        assert catalog.hw(name).source
    assert all(m.source for m in catalog.models.values())


@pytest.mark.parametrize(
    ("section", "entry", "key", "value", "message"),
    [
        ("hardware", "h100-sxm", "hbm_gib", -1, "hardware.h100-sxm.hbm_gib"),
        ("hardware", "h100-sxm", "hbm_gb", 80, "hardware.h100-sxm.hbm_gb: Extra inputs"),
        ("hardware", "l4", "host_link_sustained_gb_s", 99, "exceeds host_link_peak_gb_s"),
        ("models", "llama-3.1-8b", "num_layers", "many", "models.llama-3.1-8b.num_layers"),
        ("models", "qwen3-8b", "active_params_billions", 100, "exceeds total_params_billions"),
        ("models", "deepseek-v3", "qk_rope_head_dim", None, "MLA needs both"),
    ],
    ids=["negative-hbm", "unknown-key", "sustained-over-peak", "wrong-type", "active-over-total", "half-mla"],
)
def test_bad_entries_fail_with_their_path(section: str, entry: str, key: str, value: object, message: str) -> None:
    models, hardware = copy.deepcopy(MODELS_DOC), copy.deepcopy(HARDWARE_DOC)
    doc = models if section == "models" else hardware
    doc[section][entry][key] = value
    with pytest.raises(ProfileError, match=message):
        Catalog.from_mappings(models, hardware)


def test_unknown_top_level_key_is_rejected() -> None:
    with pytest.raises(ProfileError, match="gpus: unknown key"):
        Catalog.from_mappings(MODELS_DOC, {**HARDWARE_DOC, "gpus": {}})


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ProfileError, match="unknown hardware 'h300'.*h100-sxm"):
        load_catalog().hw("h300")


def test_missing_catalog_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_catalog(tmp_path)


@pytest.mark.parametrize(
    ("cap_w", "expected"),
    [(None, 1.0), (700, 1.0), (900, 1.0), (385, ((385 - 70) / (700 - 70)) ** 0.3333)],
    ids=["no-cap", "cap-at-tdp", "cap-above-tdp", "cap-at-55pct"],
)
def test_power_cap_compute_factor(cap_w: float | None, expected: float) -> None:
    assert load_catalog().hw("h100-sxm").power_cap_compute_factor(cap_w) == pytest.approx(expected)


def test_power_cap_below_idle_is_an_error() -> None:
    with pytest.raises(ProfileError, match="idle power"):
        load_catalog().hw("h100-sxm").power_cap_compute_factor(50)


def test_weight_bytes_prefers_explicit_gib() -> None:
    catalog = load_catalog()
    assert catalog.model("gpt-oss-20b").weight_bytes == pytest.approx(12.8 * 1024**3)
    assert catalog.model("llama-3.1-8b").weight_bytes == pytest.approx(8.03e9 * 2)
