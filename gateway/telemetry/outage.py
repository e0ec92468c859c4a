"""One log line when a dependency starts failing, one when it works again: the index's and the replicas' outages.

A dependency that fails and answers by turns (an overloaded Redis) must not cost two lines a
turn, and the last line logged must say whether it works now. So: one warning at the first
failure of an outage (with the failures counted since the last warning), and one "reachable
again" only once it has answered every call for ``stable_s``. Every failure is also counted by
the caller's own metric. Envoy logs outlier ejection and its end the same way: an event per
state change, not per failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

# Seconds of steady answers before an outage is declared over: an overloaded Redis fails and
# answers by turns, and each turn must not cost two lines.
RECOVERY_STABLE_S = 5.0


class OutageLog:
    """The state of one dependency's outage, logged on its changes (module docstring).

    Args:
        logger: where the two lines go (WARNING).
        unavailable: the first line's text, formatted with ``detail`` (what failed, and how).
        recovered: the second line's text.
        clock: monotonic seconds (injected, so a test can drive it).
        stable_s: seconds of answers with no failure before ``recovered`` is logged, ≥ 0.
        errors_noun: how the first line counts earlier failures ("; 20 <errors_noun> since the last warning").
    """

    def __init__(self, logger: logging.Logger, *, unavailable: str, recovered: str, clock: Callable[[], float],
                 stable_s: float = RECOVERY_STABLE_S, errors_noun: str = "errors") -> None:
        self.logger, self.unavailable, self.recovered = logger, unavailable, recovered
        self.clock, self.stable_s, self.errors_noun = clock, stable_s, errors_noun
        self.degraded = False  # an "unavailable" line stands, not yet followed by "reachable again"
        self._answering_since_s: float | None = None  # clock() of the first answer since the last failure
        self._failures_since_warning = 0

    def failed(self, detail: str) -> None:
        """A call failed: warn if this starts an outage."""
        self._failures_since_warning += 1
        self._answering_since_s = None
        if self.degraded:
            return
        self.degraded = True
        extra = "" if self._failures_since_warning == 1 else \
            f"; {self._failures_since_warning} {self.errors_noun} since the last warning"
        self.logger.warning("%s%s", self.unavailable.format(detail=detail), extra)
        self._failures_since_warning = 0

    def answered(self) -> None:
        """A call answered: after ``stable_s`` of answers with no failure, the outage is over."""
        if not self.degraded:
            return
        now = self.clock()
        if self._answering_since_s is None:
            self._answering_since_s = now
        if now - self._answering_since_s >= self.stable_s:
            self.degraded = False
            self._answering_since_s = None
            self.logger.warning("%s", self.recovered)
