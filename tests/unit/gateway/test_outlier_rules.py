"""Envoy's outlier and health-check rules (`gateway.backends.outlier`) and their settings, table-driven."""

from __future__ import annotations

import pytest

from fleet_config import ConfigError, OutlierDetectionSection, default_catalog, parse_settings
from gateway.backends.outlier import (
    CONSECUTIVE_5XX,
    CONSECUTIVE_GATEWAY_FAILURE,
    OutlierRecord,
    enforced,
    in_panic,
    may_eject,
)

BACKEND = {"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b", "hardware": "h100-sxm"}


def test_defaults_are_envoys() -> None:
    rules = OutlierDetectionSection()
    assert (rules.consecutive_5xx, rules.consecutive_gateway_failure, rules.enforcing_consecutive_5xx,
            rules.enforcing_consecutive_gateway_failure) == (5, 5, 100, 0)
    assert (rules.base_ejection_time_s, rules.max_ejection_s, rules.max_ejection_percent, rules.interval_s) == \
        (30.0, 300.0, 10, 10.0)
    assert rules.always_eject_one_host  # ours: one may always go (fleet_config.outlier says why)
    assert OutlierDetectionSection(base_ejection_time_s=400).max_ejection_s == 400  # max(300 s, base)


def test_the_ejection_time_is_base_times_ejections_capped_and_decays_in_rotation() -> None:
    rules = OutlierDetectionSection(base_ejection_time_s=30, max_ejection_time_s=100, interval_s=10)
    rec = OutlierRecord(hc_healthy=True, ever_healthy=True)
    lengths = []
    for i in range(5):
        lengths.append(rec.eject(1000.0 * i, rules))
        rec.uneject(1000.0 * i + lengths[-1])
    assert lengths == [30, 60, 90, 100, 100]
    assert rec.backoff == 5  # Envoy's multiplier stops once base × it passes the cap
    rec.decay(rec.unejected_s + 9, rules.interval_s)  # not yet an interval in rotation
    assert rec.backoff == 5
    for _ in range(3):
        rec.decay(rec.unejected_s + 10, rules.interval_s)  # one sweep each
    assert rec.backoff == 2
    assert rec.eject(10_000.0, rules) == 90  # 3 × 30


@pytest.mark.parametrize(("ejected", "backends", "percent", "one", "expected"), [
    (0, 2, 10, False, False),  # Envoy's default leaves a 2-backend model alone …
    (0, 2, 10, True, True),  # … unless always_eject_one_host
    (1, 2, 10, True, False),  # and then one at most
    (0, 10, 10, False, True),
    (1, 10, 10, False, False),
    (0, 2, 50, False, True),
    (1, 2, 50, False, False),  # never the whole fleet below 100%
    (1, 2, 100, False, True),
])
def test_may_eject_follows_envoys_max_ejection_percent(ejected: int, backends: int, percent: int, one: bool,
                                                      expected: bool) -> None:
    rules = OutlierDetectionSection(max_ejection_percent=percent, always_eject_one_host=one)
    assert may_eject(ejected, backends, rules) is expected


def test_consecutive_counters_detect_at_their_threshold_and_a_plain_500_resets_the_gateway_one() -> None:
    rules = OutlierDetectionSection(consecutive_5xx=3, consecutive_gateway_failure=2)
    rec = OutlierRecord()
    assert rec.failed(gateway_failure=True, rules=rules) == []
    assert rec.failed(gateway_failure=True, rules=rules) == [CONSECUTIVE_GATEWAY_FAILURE]
    rec.reset_counter(CONSECUTIVE_GATEWAY_FAILURE)
    assert rec.failed(gateway_failure=False, rules=rules) == [CONSECUTIVE_5XX]  # a 500: 5xx, not gateway
    assert rec.consecutive_gateway_failure == 0
    rec.succeeded()
    assert (rec.consecutive_5xx, rec.consecutive_gateway_failure) == (0, 0)
    assert enforced(CONSECUTIVE_5XX, rules, 99.9) and not enforced(CONSECUTIVE_GATEWAY_FAILURE, rules, 0.0)


def test_health_thresholds_and_the_first_pass() -> None:
    rec = OutlierRecord()
    rec.checked(True, unhealthy_threshold=3, healthy_threshold=2)
    assert rec.hc_healthy  # its first pass ever brings it in
    for _ in range(2):
        rec.checked(False, unhealthy_threshold=3, healthy_threshold=2)
    assert rec.hc_healthy
    rec.checked(False, unhealthy_threshold=3, healthy_threshold=2)
    assert not rec.hc_healthy
    rec.checked(True, unhealthy_threshold=3, healthy_threshold=2)
    assert not rec.hc_healthy
    rec.checked(True, unhealthy_threshold=3, healthy_threshold=2)
    assert rec.hc_healthy


@pytest.mark.parametrize(("up", "backends", "threshold", "expected"), [
    (1, 2, 50, False), (0, 2, 50, True), (1, 3, 50, True), (2, 3, 50, False), (0, 2, 0, False)])
def test_panic_below_the_threshold(up: int, backends: int, threshold: float, expected: bool) -> None:
    assert in_panic(up, backends, threshold) is expected


def test_outlier_ejection_s_is_migrated_with_a_clear_error_and_bad_values_name_their_key() -> None:
    with pytest.raises(ConfigError, match=r"outlier_ejection_s was replaced by the outlier_detection: section.*"
                                          r"base_ejection_time_s"):
        parse_settings({"gateway": {"outlier_ejection_s": 5}, "backends": [BACKEND]}, default_catalog(), env={})
    with pytest.raises(ConfigError, match=r"outlier_detection\.max_ejection_percent"):
        parse_settings({"outlier_detection": {"max_ejection_percent": 101}, "backends": [BACKEND]},
                       default_catalog(), env={})
    with pytest.raises(ConfigError, match=r"outlier_detection\.consecutive_5x"):
        parse_settings({"outlier_detection": {"consecutive_5x": 3}, "backends": [BACKEND]}, default_catalog(), env={})
    with pytest.raises(ConfigError, match=r"gateway\.unhealthy_threshold"):
        parse_settings({"gateway": {"unhealthy_threshold": 0}, "backends": [BACKEND]}, default_catalog(), env={})
    settings = parse_settings({"outlier_detection": {"base_ejection_time_s": 5}, "backends": [BACKEND]},
                              default_catalog(), env={})
    assert settings.outlier_detection.base_ejection_time_s == 5 and settings.gateway.unhealthy_threshold == 3
