"""A backend's health as Envoy keeps it: active-check counts, outlier ejection, and the panic rule.

No I/O and no clock: times (loop seconds) come in as arguments, so the rules read as Envoy's.
Sources: Envoy's outlier detector (source/common/upstream/outlier_detection_impl.cc:
``DetectorHostMonitorImpl::putHttpResponseCode``, ``DetectorImpl::ejectHost``,
``checkHostForUneject``, ``onIntervalTimer``), its ``HealthCheck`` thresholds and the load
balancer's panic threshold (docs: intro/arch_overview/upstream/load_balancing/panic_threshold).
Settings and defaults: `fleet_config.outlier`.

- **Active checks.** ``unhealthy_threshold`` failed checks in a row take a backend out,
  ``healthy_threshold`` passed ones in a row bring it back; a backend never seen healthy
  comes in at its first passed check.
- **Outliers.** Every request outcome the backend is to blame for (a 5xx before the first
  byte, a connect failure, a reset, a hang) adds to ``consecutive_5xx``, and the gateway
  failures among them (502/503/504, connect failures, resets, hangs) to
  ``consecutive_gateway_failure`` (a plain 500 zeroes that one); a complete answer zeroes both.
  A counter reaching its threshold detects an outlier, which is ejected when the
  ``enforcing_*`` chance says so and `may_eject` allows it, and the counter starts again.
- **Ejection time.** Each ejection adds one to the backend's multiplier (up to the one that
  reaches ``max_ejection_time_s``): it is out base × multiplier, at most the cap. Each
  ``interval_s`` sweep it spends in rotation takes one off again.
- **Panic** (`in_panic`): fewer than ``healthy_panic_threshold_percent`` of a model's
  backends in rotation: route to all of them, health ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet_config.outlier import OutlierDetectionSection

CONSECUTIVE_5XX = "consecutive_5xx"
CONSECUTIVE_GATEWAY_FAILURE = "consecutive_gateway_failure"


@dataclass(slots=True)
class OutlierRecord:
    """One backend's counters (Envoy's ``DetectorHostMonitor`` and active health-check session)."""

    hc_healthy: bool = False  # the active checks' verdict
    ever_healthy: bool = False  # passed a check at least once (panic mode routes only to these)
    hc_failures: int = 0  # failed checks in a row
    hc_successes: int = 0  # passed checks in a row
    consecutive_5xx: int = 0
    consecutive_gateway_failure: int = 0
    ejected_until_s: float | None = None  # loop time the current ejection ends; None: not ejected
    times_ejected: int = 0  # ejections since start (Envoy's num_ejections)
    backoff: int = 0  # the ejection time's multiplier (Envoy's ejectTimeBackoff)
    unejected_s: float | None = None  # loop time the last ejection ended

    @property
    def ejected(self) -> bool:
        return self.ejected_until_s is not None

    @property
    def in_rotation(self) -> bool:
        return self.hc_healthy and self.ejected_until_s is None

    def checked(self, ok: bool, *, unhealthy_threshold: int, healthy_threshold: int) -> None:
        """Count one active health check (Envoy's thresholds; the first pass ever suffices)."""
        if ok:
            self.hc_failures = 0
            self.hc_successes += 1
            if not self.hc_healthy and (not self.ever_healthy or self.hc_successes >= healthy_threshold):
                self.hc_healthy = self.ever_healthy = True
        else:
            self.hc_successes = 0
            self.hc_failures += 1
            if self.hc_healthy and self.hc_failures >= unhealthy_threshold:
                self.hc_healthy = False

    def failed(self, *, gateway_failure: bool, rules: OutlierDetectionSection) -> list[str]:
        """Count a request outcome the backend is to blame for; the outlier types it detected now
        (gateway failure first), for the caller to try `may_eject` and `eject` in that order."""
        detected = []
        if gateway_failure:
            self.consecutive_gateway_failure += 1
            if self.consecutive_gateway_failure == rules.consecutive_gateway_failure:
                detected.append(CONSECUTIVE_GATEWAY_FAILURE)
        else:
            self.consecutive_gateway_failure = 0
        self.consecutive_5xx += 1
        if self.consecutive_5xx == rules.consecutive_5xx:
            detected.append(CONSECUTIVE_5XX)
        return detected

    def succeeded(self) -> None:
        """A complete answer: both consecutive counters start again."""
        self.consecutive_5xx = self.consecutive_gateway_failure = 0

    def reset_counter(self, detected: str) -> None:
        """After a detection, ejected or not, its counter starts again (Envoy's onConsecutiveErrorWorker)."""
        if detected == CONSECUTIVE_5XX:
            self.consecutive_5xx = 0
        else:
            self.consecutive_gateway_failure = 0

    def eject(self, now_s: float, rules: OutlierDetectionSection) -> float:
        """Eject now; returns the ejection's length, s: base × multiplier, at most the cap."""
        base_s, cap_s = rules.base_ejection_time_s, rules.max_ejection_s
        if self.backoff * base_s < cap_s + base_s:
            self.backoff += 1
        self.times_ejected += 1
        duration_s = min(base_s * self.backoff, cap_s)
        self.ejected_until_s = now_s + duration_s
        return duration_s

    def uneject(self, now_s: float) -> None:
        """Back from an ejection: its counters start again (Envoy's unejectHost)."""
        self.ejected_until_s = None
        self.unejected_s = now_s
        self.consecutive_5xx = self.consecutive_gateway_failure = 0

    def decay(self, now_s: float, interval_s: float) -> None:
        """One sweep: in rotation for an interval since its last ejection, the multiplier drops by one."""
        if (self.ejected_until_s is None and self.unejected_s is not None and self.backoff
                and now_s - self.unejected_s >= interval_s):
            self.backoff -= 1


def enforced(detected: str, rules: OutlierDetectionSection, draw_percent: float) -> bool:
    """Whether a detected outlier is ejected: ``draw_percent`` (uniform in [0, 100)) below its
    ``enforcing_*`` percentage."""
    percent = (rules.enforcing_consecutive_5xx if detected == CONSECUTIVE_5XX
               else rules.enforcing_consecutive_gateway_failure)
    return draw_percent < percent


def may_eject(ejected: int, backends: int, rules: OutlierDetectionSection) -> bool:
    """Envoy's ``ejectHost`` rule: one more ejection keeps the ejected share of the model's
    ``backends`` within ``max_ejection_percent`` — or none is ejected and ``always_eject_one_host``."""
    if backends <= 0:
        return False
    if 100.0 * (ejected + 1) / backends <= rules.max_ejection_percent:
        return True
    return rules.always_eject_one_host and ejected == 0


def in_panic(in_rotation: int, backends: int, threshold_percent: float) -> bool:
    """Fewer than ``threshold_percent`` of a model's ``backends`` in rotation (0 turns panic off)."""
    return backends > 0 and 100.0 * in_rotation / backends < threshold_percent
