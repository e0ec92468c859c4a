"""Config parsing: strict, with the path of the bad key; every shipped fleet file loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.errors import ConfigError
from fleet_config.settings import load_settings, parse_settings

CATALOG = default_catalog()
BACKEND = {"id": "a", "url": "http://127.0.0.1:8001", "model": "llama-3.1-8b", "hardware": "h100-sxm"}


def doc(**overrides: object) -> dict:
    return {"backends": [dict(BACKEND)], **overrides}


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("fleet*.yaml")) + sorted((CONFIG_DIR / "fleets").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_fleet_configs_load(path: Path) -> None:
    settings = load_settings(path, CATALOG, env={})
    assert settings.backends


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (doc(gateway={"port": 70000}), r"gateway\.port: Input should be less than or equal to 65535"),
        (doc(gateway={"prot": 1}), r"gateway\.prot: Extra inputs are not permitted"),
        (doc(routing={"policy": "fastest"}), r"routing: Value error, unknown policy 'fastest'"),
        (doc(routing={"policy": "kappa", "params": {"x": 1}}), r"unknown parameter 'x'"),
        (doc(index={"backend": "redis"}), r"index: Value error, backend 'redis' needs redis_url"),
        ({"backends": [{**BACKEND, "hardware": "h300"}]}, r"backends\[0\]\.hardware: unknown hardware 'h300'"),
        ({"backends": [{**BACKEND, "model": "gpt-9"}]}, r"backends\[0\]\.model: 'gpt-9' is neither"),
        ({"backends": [{**BACKEND, "url": "127.0.0.1:8001"}]}, r"backends\[0\]\.url: Value error, must be http"),
        ({"backends": [BACKEND, {**BACKEND, "url": "http://127.0.0.1:8002"}]}, r"backends\[1\]\.id: duplicate"),
        ({"backends": [{**BACKEND, "power_cap_w": 10}]}, r"backends\[0\]: .*idle power"),
        (doc(kv_pool={"capacity_gb": 0}), r"kv_pool\.capacity_gb: Input should be greater than 0"),
        (doc(kv_pool={"capacity_gb": 10, "bandwidth": 5}), r"kv_pool\.bandwidth: Extra inputs are not permitted"),
        (doc(kv_pool={"capacity_gbb": 10}),
         r"^kv_pool\.capacity_gbb: Extra inputs are not permitted; kv_pool\.capacity_gb: Field required$"),
        ({"backends": [{**BACKEND, "kv_pool_link_gb_s": 40}]}, r"backends\[0\]\.kv_pool_link_gb_s is set but there is no kv_pool"),
        ({"backends": [{**BACKEND, "colour": "red"}]}, r"backends\[0\]\.colour: Extra inputs"),
        ({"backends": []}, r"backends: List should have at least 1 item"),
        ({"models": {"m": {"profile": "nope"}}, "backends": [BACKEND]}, r"models\.m\.profile: unknown model profile"),
        ([1, 2], r"config: the file must hold a mapping"),
    ],
    ids=["port-range", "typo-key", "unknown-policy", "policy-param", "redis-no-url", "unknown-hardware",
         "unknown-model", "bad-url", "duplicate-id", "cap-below-idle", "pool-size", "pool-typo", "pool-required-key-typo", "pool-link-no-pool", "unknown-backend-key", "no-backends",
         "unknown-profile", "not-a-mapping"],
)
def test_bad_config_fails_with_its_path(config: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(config, CATALOG, env={})


def test_environment_overrides_listen_address_and_redis() -> None:
    settings = parse_settings(doc(), CATALOG, env={"KAPPA_PORT": "9100", "KAPPA_HOST": "0.0.0.0",
                                                   "KAPPA_REDIS_URL": "redis://127.0.0.1:6390/0"})
    assert (settings.gateway.port, settings.gateway.host) == (9100, "0.0.0.0")
    assert (settings.index.backend, settings.index.redis_url) == ("redis", "redis://127.0.0.1:6390/0")


def test_served_model_names_map_to_profiles() -> None:
    settings = parse_settings({"models": {"meta-llama/Llama-3.1-8B-Instruct": {"profile": "llama-3.1-8b"}},
                               "backends": [{**BACKEND, "model": "meta-llama/Llama-3.1-8B-Instruct"}]}, CATALOG, env={})
    spec = settings.backend_spec(CATALOG, settings.backends[0])
    assert spec.model.name == "llama-3.1-8b"
    assert settings.served_models() == ["meta-llama/Llama-3.1-8B-Instruct"]


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", CATALOG, env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(bad, CATALOG, env={})


def test_a_kv_pool_gives_each_backend_a_pool_link() -> None:
    settings = parse_settings({"kv_pool": {"capacity_gb": 500, "link_gb_s_per_gpu": 10},
                               "backends": [{**BACKEND, "tensor_parallel": 4},
                                            {**BACKEND, "id": "b", "url": "http://127.0.0.1:8002", "kv_pool_link_gb_s": 7}]},
                              CATALOG, env={})
    a, b = (settings.backend_spec(CATALOG, entry) for entry in settings.backends)
    assert (a.kv_pool_link_bytes_per_s, b.kv_pool_link_bytes_per_s) == (40e9, 7e9)  # min(10, 15) × 4; the override
    plain = parse_settings(doc(), CATALOG, env={})
    assert plain.kv_pool is None and plain.backend_spec(CATALOG, plain.backends[0]).kv_pool_link_bytes_per_s == 0
