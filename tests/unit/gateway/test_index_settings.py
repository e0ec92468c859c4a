"""The Redis index's keys of the ``index:`` section (issue 16): defaults, and bad values fail with their path."""

from __future__ import annotations

import pytest

from fleet_config.catalog import default_catalog
from fleet_config.errors import ConfigError
from fleet_config.sections import DEFAULT_LOAD_SYNC_INTERVAL_S
from fleet_config.settings import parse_settings
from prefix_index.redis_defaults import DEFAULT_KEY_PREFIX, DEFAULT_KEY_TTL_S, DEFAULT_TIMEOUT_S

CATALOG = default_catalog()
BACKEND = {"id": "a", "url": "http://127.0.0.1:8001", "model": "llama-3.1-8b", "hardware": "h100-sxm"}


def parse(index: dict):
    return parse_settings({"index": index, "backends": [BACKEND]}, CATALOG, env={})


def test_defaults() -> None:
    cfg = parse({}).index
    # The Redis index's own defaults (prefix_index.redis_defaults), not restated by the config.
    assert (cfg.key_prefix, cfg.timeout_s, cfg.key_ttl_s) == (DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT_S, DEFAULT_KEY_TTL_S)
    assert cfg.load_sync_interval_s == DEFAULT_LOAD_SYNC_INTERVAL_S
    assert (cfg.breaker_failures, cfg.breaker_open_s, cfg.breaker_max_open_s) == (3, 1.0, 4.0)


@pytest.mark.parametrize(("index", "message"), [
    ({"key_ttl_s": 0}, r"index\.key_ttl_s: Input should be greater than or equal to 1"),
    ({"key_ttl_s": 1.5}, r"index\.key_ttl_s: Input should be a valid integer"),
    ({"breaker_failures": 0}, r"index\.breaker_failures: Input should be greater than or equal to 1"),
    ({"breaker_open_s": 0}, r"index\.breaker_open_s: Input should be greater than 0"),
    ({"breaker_open_s": 5, "breaker_max_open_s": 2}, r"index: Value error, breaker_max_open_s \(2\.0\) must be >= "
                                                     r"breaker_open_s \(5\.0\)"),
    ({"breaker": {"failures": 3}}, r"index\.breaker: Extra inputs are not permitted"),
], ids=["ttl-zero", "ttl-fraction", "failures-zero", "open-zero", "max-below-open", "nested-typo"])
def test_bad_index_keys_fail_with_their_path(index: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(index)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
                                 "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0"])
def test_redis_url_forms_are_accepted(url: str) -> None:
    assert parse({"backend": "redis", "redis_url": url}).index.redis_url == url


def test_a_redis_url_of_no_known_form_fails_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"index\.redis_url: Value error, redis_url scheme must be one of"):
        parse({"backend": "redis", "redis_url": "sentinel://10.0.0.1:26379"})
    with pytest.raises(ConfigError, match=r"index\.redis_url: Value error, redis\+cluster:// takes no db"):
        parse_settings({"index": {"backend": "redis"}, "backends": [BACKEND]}, CATALOG,
                       env={"KAPPA_REDIS_URL": "redis+cluster://10.0.0.1:7000/1"})
