"""Which backends take requests: health-check verdicts, outlier ejections and panic mode, per model.

`Rotation` applies the rules of `gateway.backends.outlier` (Envoy's) to the backends' states
and keeps what follows from them: ``BackendState.healthy`` (in rotation: its checks pass and
it is not ejected), ``gateway_backend_up``, the ejection timers, and per model whether it is
in panic mode — then `Rotation.eligible` is every backend of the model that ever passed a
health check and serves the model, healthy or not (Envoy routes to all hosts in panic; a
backend never seen up, or listing other models, is left out, so a fleet that never came up
answers 503 rather than connect failures). Entering and leaving panic is logged once each,
counted in ``gateway_panic_mode_entries_total`` and shown in ``gateway_panic_mode``.

A backend leaving rotation resolves its down signal (`Rotation.down_signal`): requests waiting
for its first byte may then move to another backend (`gateway.proxy.attempts`).
"""

from __future__ import annotations

import asyncio
import logging
import random

from fleet_config.outlier import OutlierDetectionSection
from gateway.backends.backend_state import BackendState
from gateway.backends.outlier import enforced, in_panic, may_eject
from gateway.telemetry.metrics import Telemetry

log = logging.getLogger("kappa_gateway.pool")


class Rotation:
    """The backends in rotation and the rules that move them (module docstring).

    Args:
        states: every configured backend, in config order.
        telemetry: where ``gateway_backend_up``, ejections and panic mode go.
        rules: Envoy's outlier detection settings.
        unhealthy_threshold, healthy_threshold: failed / passed health checks in a row that
            take a backend out / bring it back.
        healthy_panic_threshold_percent: panic below this % of a model's backends in rotation.
        rng: draws for the ``enforcing_*`` percentages.
    """

    def __init__(self, states: list[BackendState], telemetry: Telemetry, rules: OutlierDetectionSection, *,
                 unhealthy_threshold: int, healthy_threshold: int, healthy_panic_threshold_percent: float,
                 rng: random.Random | None = None) -> None:
        self.rules = rules
        self.unhealthy_threshold, self.healthy_threshold = unhealthy_threshold, healthy_threshold
        self._panic_threshold_percent = healthy_panic_threshold_percent
        self._telemetry = telemetry
        self._rng = rng or random.Random()
        self.by_model: dict[str, list[BackendState]] = {}
        for s in states:
            self.by_model.setdefault(s.entry.model, []).append(s)
        self.panic = dict.fromkeys(self.by_model, False)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._last_sweep_s: float | None = None
        for model in self.by_model:
            telemetry.panic_mode.labels(model).set(0)
            telemetry.panic_mode_entries.labels(model)

    def eligible(self, model: str) -> list[BackendState]:
        """The backends a request for ``model`` may go to, in config order: those in rotation,
        or in panic mode every one that ever passed a health check and serves the model."""
        members = self.by_model.get(model, [])
        if self.panic.get(model, False):
            return [s for s in members if s.outlier.ever_healthy and not s.serves_other_model]
        return [s for s in members if s.healthy]

    def checked(self, state: BackendState, ok: bool, now_s: float, error: str | None = None) -> None:
        """Count one active health check of ``state`` (``error``: why it failed) and apply its
        consequences. Logged once per change: up, out of rotation, or — for a backend not up —
        each new reason it is not (a backend that never came up says why from its first check)."""
        rec = state.outlier
        was = rec.hc_healthy
        last_error, state.check_error = state.check_error, None if ok else (error or "failed")
        rec.checked(ok, unhealthy_threshold=self.unhealthy_threshold, healthy_threshold=self.healthy_threshold)
        if ok and rec.ejected and self.rules.successful_active_health_check_uneject_host:
            self._uneject(state, now_s, "it passed a health check")
        if rec.hc_healthy and not was:
            log.info("backend %s is up", state.id)
        elif was and not rec.hc_healthy:
            log.warning("backend %s failed %d health checks in a row: out of rotation (%s)", state.id, rec.hc_failures,
                        state.check_error)
        elif not ok and was:
            log.info("backend %s failed a health check (%d of %d before it leaves rotation): %s", state.id,
                     rec.hc_failures, self.unhealthy_threshold, state.check_error)
        elif not ok and state.check_error != last_error:
            log.warning("backend %s is not up: %s", state.id, state.check_error)
        self.update(state, "it failed its health checks")

    def failed(self, state: BackendState, reason: str, *, gateway_failure: bool = True) -> None:
        """A request outcome ``state`` is to blame for (a 5xx before the first byte, a connect
        failure, a reset, a hang): count it; eject on a detection that Envoy's rules enforce.
        ``gateway_failure``: a 502/503/504 or a failure mapped to one (all but a plain 5xx)."""
        rec = state.outlier
        for detected in rec.failed(gateway_failure=gateway_failure, rules=self.rules):
            if rec.ejected:
                return  # already out: Envoy leaves the counter as it is until the ejection ends
            members = self.by_model[state.entry.model]
            ejected = sum(s.outlier.ejected for s in members)
            if not may_eject(ejected, len(members), self.rules):
                self._telemetry.outlier_ejections_overflow.labels(state.id).inc()
                log.warning("backend %s is an outlier (%s, last: %s) but stays: %d of the %d backends of %s are "
                            "ejected already (max_ejection_percent %d)", state.id, detected, reason, ejected,
                            len(members), state.entry.model, self.rules.max_ejection_percent)
            elif enforced(detected, self.rules, 100.0 * self._rng.random()):
                self._eject(state, detected, reason)
            rec.reset_counter(detected)

    def succeeded(self, state: BackendState) -> None:
        """A complete answer from ``state``: its consecutive-failure counts start again."""
        state.outlier.succeeded()

    def sweep(self, now_s: float) -> None:
        """Envoy's interval sweep: every ``interval_s``, backends in rotation since their last
        ejection for that long get one off their ejection-time multiplier."""
        if self._last_sweep_s is not None and now_s - self._last_sweep_s < self.rules.interval_s:
            return
        self._last_sweep_s = now_s
        for members in self.by_model.values():
            for s in members:
                s.outlier.decay(now_s, self.rules.interval_s)

    def down_signal(self, state: BackendState) -> asyncio.Future[str]:
        """A future that resolves (to the reason) when ``state`` next leaves rotation."""
        signal = state.down_signal
        if signal is None or signal.done():
            signal = state.down_signal = asyncio.get_running_loop().create_future()
        return signal

    def update(self, state: BackendState, reason: str) -> None:
        """``state.healthy`` and everything after it from its record: the gauge, its waiters'
        down signal, its model's panic mode."""
        healthy = state.outlier.in_rotation and not state.serves_other_model
        if healthy == state.healthy:
            return
        state.healthy = healthy
        self._telemetry.backend_up.labels(state.id).set(1 if healthy else 0)
        if not healthy and state.down_signal is not None and not state.down_signal.done():
            state.down_signal.set_result(reason)
        self.refresh_panic(state.entry.model)

    def refresh_panic(self, model: str) -> None:
        """Enter or leave panic mode for ``model`` (logged and counted once per change)."""
        members = self.by_model[model]
        up = sum(s.healthy for s in members)
        panic = in_panic(up, len(members), self._panic_threshold_percent)
        if panic == self.panic[model]:
            return
        self.panic[model] = panic
        self._telemetry.panic_mode.labels(model).set(1 if panic else 0)
        if panic:
            self._telemetry.panic_mode_entries.labels(model).inc()
            log.warning("model %s: panic mode: %d of %d backends in rotation (below %g%%), routing to every one that "
                        "ever passed a health check", model, up, len(members), self._panic_threshold_percent)
        else:
            log.warning("model %s: panic mode over: %d of %d backends in rotation", model, up, len(members))

    def view(self, state: BackendState) -> dict[str, object]:
        """What ``/v1/kappa/backends`` shows of ``state``'s health: the active checks' verdict and
        counts, the outlier counters, and the ejection's remaining time (s; null when not ejected)."""
        rec = state.outlier
        remaining_s = None
        if rec.ejected_until_s is not None:
            remaining_s = round(max(0.0, rec.ejected_until_s - asyncio.get_running_loop().time()), 3)
        return {"unhealthy_reason": None if state.healthy else unhealthy_reason(state),
                "health_check_passing": rec.hc_healthy, "health_check_failures": rec.hc_failures,
                "serves_other_model": state.serves_other_model, "ejected": rec.ejected,
                "ejection_remaining_s": remaining_s, "times_ejected": rec.times_ejected,
                "consecutive_5xx": rec.consecutive_5xx, "consecutive_gateway_failure": rec.consecutive_gateway_failure}

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _eject(self, state: BackendState, detected: str, reason: str) -> None:
        loop = asyncio.get_running_loop()
        duration_s = state.outlier.eject(loop.time(), self.rules)
        log.warning("backend %s ejected for %gs (%s, ejection %d; last: %s)", state.id, duration_s, detected,
                    state.outlier.times_ejected, reason)
        self._telemetry.outlier_ejections.labels(state.id).inc()
        self._timers[state.id] = loop.call_later(duration_s, self._ejection_over, state)
        self.update(state, f"ejected: {reason}")

    def _ejection_over(self, state: BackendState) -> None:
        self._timers.pop(state.id, None)
        self._uneject(state, asyncio.get_running_loop().time(), "its ejection time is over")

    def _uneject(self, state: BackendState, now_s: float, why: str) -> None:
        timer = self._timers.pop(state.id, None)
        if timer is not None:
            timer.cancel()
        state.outlier.uneject(now_s)
        log.info("backend %s back from ejection: %s", state.id, why)
        self.update(state, "")


def unhealthy_reason(state: BackendState) -> str:
    """Why ``state`` is out of rotation, in words: its ejection, or its last failed check's error."""
    if state.outlier.ejected:
        return f"ejected by outlier detection (ejection {state.outlier.times_ejected})"
    if state.check_error is not None:
        return state.check_error
    return "not checked yet" if not state.outlier.ever_healthy else "failed its health checks"
