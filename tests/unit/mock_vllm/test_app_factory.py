"""A mock is built from its backend's config entry: every field the gateway reads reaches the engine."""

from __future__ import annotations

import pytest

from fleet_config import BackendEntry, default_catalog, parse_settings
from gateway.commands.fleet_worker import build_apps
from mock_vllm.app_factory import engine_config, shared_kv_pool, standalone_settings
from mock_vllm.engine import MockEngine

CATALOG = default_catalog()
BACKENDS = [{"id": "a", "url": "http://127.0.0.1:8001", "model": "llama-3.1-8b", "hardware": "h100-sxm"},
            {"id": "b", "url": "http://127.0.0.1:8002", "model": "llama-3.1-8b", "hardware": "b200"}]

# Every field of a backend entry, each away from its default, as `kappa-gateway mock-fleet` gets them.
EVERY_FIELD = {"id": "h100", "url": "http://127.0.0.1:8009", "model": "served-8b", "hardware": "h100-sxm",
               "power_cap_w": 450.0, "tensor_parallel": 2, "host_tier_gb": 64.0, "host_link_gb_s": 41.0,
               "kv_pool_link_gb_s": 33.0, "overlap_host_load": False, "num_gpu_blocks_override": 1234,
               "labels": {"role": "power-capped"}, "kv_role": "decode", "node": "hgx-1",
               "kv_events": {"endpoint": "tcp://127.0.0.1:5599", "replay_endpoint": "tcp://127.0.0.1:5600",
                             "topic": "kv@h100@served-8b"}}
# Fields a mock has no use for: where it listens comes from `url` (the worker binds it), and
# labels are the operator's (the demo report reads them); every other field shapes the engine.
NOT_THE_ENGINES = {"id", "url", "labels"}


def engine_of(app) -> MockEngine:
    return app.state.engine


def test_a_mock_fleet_backend_honours_every_backend_field_the_gateway_reads() -> None:
    """Regression: mock-fleet passed its mocks command-line flags that dropped host_link_gb_s
    and overlap_host_load, so its mocks ran at the profile's link while the gateway priced
    the configured one."""
    assert set(BackendEntry.model_fields) == set(EVERY_FIELD), "a new backend field: add it here and to the mock"
    settings = parse_settings({"models": {"served-8b": {"profile": "llama-3.1-8b"}},
                               "kv_pool": {"capacity_gb": 10.0}, "backends": [EVERY_FIELD],
                               "interconnect": {"intra_node": {"bandwidth_gb_s": 450}}}, CATALOG, env={})
    entry = settings.backends[0]
    [app] = build_apps(settings, CATALOG, settings.backends, time_scale=0.01)
    engine = engine_of(app)
    spec = settings.backend_spec(CATALOG, entry)
    assert engine.backend == spec  # model, hardware, power cap, TP, host link, overlap, pool link
    assert (spec.model.name, spec.hardware.name, spec.power_cap_w, spec.tensor_parallel) == (
        "llama-3.1-8b", "h100-sxm", 450.0, 2)
    assert (spec.host_link_gb_s, spec.overlap_host_load, spec.kv_pool_link_gb_s) == (41.0, False, 33.0)
    assert engine.config == engine_config(entry)
    assert engine.config.host_tier_bytes == 64e9 and engine.stats.num_gpu_blocks == 1234
    assert engine.cache.kv_pool is not None
    pd = app.state.pd.settings  # P/D: its role, its id as its NIXL engine id, its node in the link table
    assert (pd.kv_role, pd.engine_id, dict(pd.interconnect.nodes)) == ("decode", "h100", {"h100": "hgx-1"})
    events = app.state.kv_events.publisher.config  # bound where the gateway connects (sockets open at start-up)
    assert (events.endpoint, events.replay_endpoint, events.topic, events.bind, events.encoding) == (
        "tcp://127.0.0.1:5599", "tcp://127.0.0.1:5600", "kv@h100@served-8b", True, "map")
    assert engine.kv_events is app.state.kv_events.recorder
    honoured = {"model", "hardware", "power_cap_w", "tensor_parallel", "host_tier_gb", "host_link_gb_s",
                "kv_pool_link_gb_s", "overlap_host_load", "num_gpu_blocks_override", "kv_role", "node", "kv_events"}
    assert honoured | NOT_THE_ENGINES == set(EVERY_FIELD)


def test_a_standalone_mock_is_a_one_backend_config() -> None:
    settings, entry = standalone_settings("llama-3.1-70b", "b200", CATALOG, served_model_name="big",
                                          tensor_parallel=2, host_link_gb_s=50.0, overlap_host_load=False)
    assert settings.served_models() == ["big"] and entry.model == "big"
    spec = settings.backend_spec(CATALOG, entry)
    assert spec.model.name == "llama-3.1-70b" and spec.link_bytes_per_s == 50e9 and not spec.overlap_host_load


@pytest.mark.parametrize(("capacity_gb", "blocks"), [
    (1.0, 476),  # 1e9 B // (16 tokens × 131,072 B/token of Llama-3.1-8B) = 1e9 // 2,097,152
    (100.0, 47_683),
], ids=["1GB", "100GB"])
def test_pool_blocks_are_capacity_over_one_16_token_block(capacity_gb: float, blocks: int) -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": capacity_gb}, "backends": BACKENDS}, CATALOG, env={})
    assert shared_kv_pool(settings, CATALOG, settings.backends).num_blocks == blocks


def test_one_app_per_backend_on_one_pool() -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": 1.0}, "backends": BACKENDS}, CATALOG, env={})
    apps = build_apps(settings, CATALOG, settings.backends, time_scale=0.01)
    pools = {id(engine_of(app).cache.kv_pool) for app in apps}
    assert len(apps) == 2 and len(pools) == 1 and engine_of(apps[0]).cache.kv_pool.num_blocks == 476


def test_without_a_kv_pool_section_each_mock_has_none() -> None:
    settings = parse_settings({"backends": BACKENDS}, CATALOG, env={})
    assert all(engine_of(app).cache.kv_pool is None for app in build_apps(settings, CATALOG, settings.backends,
                                                                        time_scale=0.01))
    with pytest.raises(ValueError, match="kv_pool"):
        shared_kv_pool(settings, CATALOG, settings.backends)


def test_a_pool_smaller_than_one_block_is_refused() -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": 0.001}, "backends": BACKENDS}, CATALOG, env={})
    with pytest.raises(ValueError, match="holds no 2,097,152-byte KV block of llama-3.1-8b"):
        shared_kv_pool(settings, CATALOG, settings.backends)
