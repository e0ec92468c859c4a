"""Outlier detection, active health-check thresholds and the panic threshold: Envoy's names and defaults.

The ``outlier_detection:`` section of the fleet YAML is Envoy's ``OutlierDetection`` message
(api/envoy/config/cluster/v3/outlier_detection.proto), durations in seconds (``_s``):

    consecutive_5xx                          5    failures in a row (5xx before the first byte,
                                                  connect failures, resets, hangs) before an ejection
    consecutive_gateway_failure              5    the same, counting only 502/503/504 and the
                                                  connection failures and hangs mapped to them
    enforcing_consecutive_5xx              100    % chance a detected consecutive_5xx outlier is ejected
    enforcing_consecutive_gateway_failure    0    % chance for consecutive_gateway_failure (Envoy's 0:
                                                  detected and logged, not enforced)
    interval_s                              10    period of the sweep that shortens the ejection
                                                  time of backends that stayed in rotation
    base_ejection_time_s                    30    the first ejection's length; the n-th (without a
                                                  sweep's decrement between) is n × this …
    max_ejection_time_s                    300    … capped here (unset: max(300, base_ejection_time_s))
    max_ejection_percent                    10    at most this % of a model's backends ejected at once
    always_eject_one_host                 true    eject one backend even when that exceeds
                                                  max_ejection_percent (Envoy ≥ 1.31's key; see below)
    successful_active_health_check_uneject_host
                                         false    a passed health check ends an ejection (Envoy's
                                                  default is true; see below)

Three departures from Envoy, all deliberate. ``always_eject_one_host`` defaults to true (Envoy:
false): with ``max_ejection_percent`` 10, a model served by fewer than 10 backends — the usual LLM
fleet, 2–8 GPU servers — could never have a hung backend ejected (Envoy's own docs once said
"will eject at least one host regardless"); beyond the first, the percentage caps as in Envoy.
``successful_active_health_check_uneject_host``
defaults to false: the gateway's active check is ``GET /health``, which a hung engine still
answers, so Envoy's default would end every ejection of a hung backend at its next check.
And Envoy's ``max_ejection_time_jitter`` is not offered (one gateway, few backends: no herd).

The active health checks' thresholds and the panic threshold sit in ``gateway:``
(`fleet_config.settings.GatewaySection`), with Envoy's ``HealthCheck`` and ``CommonLbConfig``
names; Envoy requires the two thresholds and gives them no default, so the defaults here are
Envoy Gateway's (``unhealthyThreshold`` 3, ``healthyThreshold`` 1), and the first passed check
of a backend never seen healthy brings it in, as Envoy does at start-up.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_CONSECUTIVE_5XX = 5
DEFAULT_CONSECUTIVE_GATEWAY_FAILURE = 5
DEFAULT_INTERVAL_S = 10.0
DEFAULT_BASE_EJECTION_TIME_S = 30.0
DEFAULT_MAX_EJECTION_TIME_S = 300.0
DEFAULT_MAX_EJECTION_PERCENT = 10
DEFAULT_UNHEALTHY_THRESHOLD = 3
DEFAULT_HEALTHY_THRESHOLD = 1
DEFAULT_HEALTHY_PANIC_THRESHOLD_PERCENT = 50.0


class OutlierDetectionSection(BaseModel):
    """Envoy's ``OutlierDetection`` (module docstring); every key optional."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    consecutive_5xx: int = Field(default=DEFAULT_CONSECUTIVE_5XX, ge=1)
    consecutive_gateway_failure: int = Field(default=DEFAULT_CONSECUTIVE_GATEWAY_FAILURE, ge=1)
    enforcing_consecutive_5xx: int = Field(default=100, ge=0, le=100)
    enforcing_consecutive_gateway_failure: int = Field(default=0, ge=0, le=100)
    interval_s: float = Field(default=DEFAULT_INTERVAL_S, gt=0)
    base_ejection_time_s: float = Field(default=DEFAULT_BASE_EJECTION_TIME_S, gt=0)
    max_ejection_time_s: float | None = Field(default=None, gt=0)
    max_ejection_percent: int = Field(default=DEFAULT_MAX_EJECTION_PERCENT, ge=0, le=100)
    always_eject_one_host: bool = True
    successful_active_health_check_uneject_host: bool = False

    @property
    def max_ejection_s(self) -> float:
        """The cap on one ejection, s: ``max_ejection_time_s``, or Envoy's default of
        max(300 s, ``base_ejection_time_s``) when unset."""
        if self.max_ejection_time_s is not None:
            return self.max_ejection_time_s
        return max(DEFAULT_MAX_EJECTION_TIME_S, self.base_ejection_time_s)
