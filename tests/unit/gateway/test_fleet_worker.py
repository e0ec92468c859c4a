"""Sizing the mock fleet's shared KV pool from the config (`gateway.fleet_worker`)."""

from __future__ import annotations

import pytest

from gateway.catalog import default_catalog
from gateway.fleet_worker import build_pooled_apps, pool_num_blocks
from gateway.settings import parse_settings

CATALOG = default_catalog()
BACKENDS = [{"id": "a", "url": "http://127.0.0.1:8001", "model": "llama-3.1-8b", "hardware": "h100-sxm"},
            {"id": "b", "url": "http://127.0.0.1:8002", "model": "llama-3.1-8b", "hardware": "b200"}]


@pytest.mark.parametrize(("capacity_gb", "blocks"), [
    (1.0, 476),  # 1e9 B // (16 tokens × 131,072 B/token of Llama-3.1-8B) = 1e9 // 2,097,152
    (100.0, 47_683),
], ids=["1GB", "100GB"])
def test_pool_blocks_are_capacity_over_one_16_token_block(capacity_gb: float, blocks: int) -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": capacity_gb}, "backends": BACKENDS}, CATALOG, env={})
    assert pool_num_blocks(settings, CATALOG, settings.backends) == blocks


def test_one_app_per_backend_on_one_pool() -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": 1.0}, "backends": BACKENDS}, CATALOG, env={})
    pool, apps = build_pooled_apps(settings, CATALOG, settings.backends, time_scale=0.01)
    assert pool.num_blocks == 476 and len(apps) == 2


def test_a_pool_needs_a_kv_pool_section() -> None:
    settings = parse_settings({"backends": BACKENDS}, CATALOG, env={})
    with pytest.raises(ValueError, match="kv_pool"):
        pool_num_blocks(settings, CATALOG, settings.backends)


def test_a_pool_smaller_than_one_block_is_refused() -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": 0.001}, "backends": BACKENDS}, CATALOG, env={})
    with pytest.raises(ValueError, match="holds no 2,097,152-byte KV block of llama-3.1-8b"):
        pool_num_blocks(settings, CATALOG, settings.backends)
