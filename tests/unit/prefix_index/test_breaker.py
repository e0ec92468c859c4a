"""`prefix_index.breaker.CircuitBreaker`: the state machine, table-driven, no event loop.

Each row is a script of events on a breaker (threshold 3, open 1 s, max open 4 s) and the
state and admissions expected after it. Events: ``("admit", t)`` records the admission in
the ``admitted`` list, ``("ok"|"fail"|"abandon", t, i)`` reports the outcome of the i-th
admission.
"""

from __future__ import annotations

import pytest

from prefix_index.breaker import Admission, BreakerState, CircuitBreaker

CALL, PROBE, SKIP = Admission.CALL, Admission.PROBE, Admission.SKIP
CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def run(events: list[tuple]) -> tuple[CircuitBreaker, list[Admission]]:
    breaker = CircuitBreaker(failure_threshold=3, open_s=1.0, max_open_s=4.0)
    admitted: list[Admission] = []
    for event in events:
        if event[0] == "admit":
            admitted.append(breaker.admit(event[1]))
        else:
            kind, t, i = event
            {"ok": breaker.succeeded, "fail": breaker.failed, "abandon": breaker.abandoned}[kind](admitted[i], t)
    return breaker, admitted


def fails(n: int, t: float = 0.0, first: int = 0) -> list[tuple]:
    """n calls admitted at t that then fail (admissions first .. first + n - 1)."""
    return [("admit", t)] * n + [("fail", t, first + i) for i in range(n)]


CASES = [
    ("two failures stay closed", fails(2) + [("admit", 0.1)], CLOSED, [CALL, CALL, CALL]),
    ("three consecutive failures open it and skip", fails(3) + [("admit", 0.1), ("admit", 0.99)], OPEN,
     [CALL] * 3 + [SKIP, SKIP]),
    ("a success in between resets the count",
     fails(2) + [("admit", 0.0), ("ok", 0.0, 2)] + fails(2, first=3) + [("admit", 0.1)], CLOSED, [CALL] * 6),
    ("after open_s exactly one probe, the rest skip", fails(3) + [("admit", 1.0), ("admit", 1.0), ("admit", 1.5)],
     HALF_OPEN, [CALL] * 3 + [PROBE, SKIP, SKIP]),
    ("a successful probe closes it", fails(3) + [("admit", 1.0), ("ok", 1.01, 3), ("admit", 1.02)], CLOSED,
     [CALL] * 3 + [PROBE, CALL]),
    ("a failed probe reopens it for twice as long",
     fails(3) + [("admit", 1.0), ("fail", 1.05, 3), ("admit", 2.9), ("admit", 3.05)], HALF_OPEN,
     [CALL] * 3 + [PROBE, SKIP, PROBE]),
    ("the doubled wait stops at max_open_s",
     fails(3) + [("admit", 1.0), ("fail", 1.0, 3), ("admit", 3.0), ("fail", 3.0, 4), ("admit", 7.0),
                 ("fail", 7.0, 5), ("admit", 10.9), ("admit", 11.0)], HALF_OPEN,
     [CALL] * 3 + [PROBE, PROBE, PROBE, SKIP, PROBE]),
    ("a close resets the wait to open_s",
     fails(3) + [("admit", 1.0), ("fail", 1.0, 3), ("admit", 3.0), ("ok", 3.0, 4)] + fails(3, 3.0, 5)
     + [("admit", 3.99), ("admit", 4.0)], HALF_OPEN, [CALL] * 3 + [PROBE, PROBE] + [CALL] * 3 + [SKIP, PROBE]),
    ("an abandoned probe lets the next call probe at once",
     fails(3) + [("admit", 1.0), ("admit", 1.0), ("abandon", 1.2, 3), ("admit", 1.2)], HALF_OPEN,
     [CALL] * 3 + [PROBE, SKIP, PROBE]),
    ("late outcomes of calls admitted before it opened change nothing",
     fails(3) + [("admit", 0.0), ("ok", 0.5, 2), ("fail", 0.5, 2), ("admit", 0.6)], OPEN,
     [CALL] * 3 + [SKIP, SKIP]),
    ("a late success does not close a half-open breaker; only the probe does",
     [("admit", 0.0)] + fails(3, first=1) + [("admit", 1.0), ("ok", 1.1, 0), ("admit", 1.2)], HALF_OPEN,
     [CALL] * 4 + [PROBE, SKIP]),
]


@pytest.mark.parametrize(("events", "state", "admissions"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_breaker_state_machine(events: list[tuple], state: BreakerState, admissions: list[Admission]) -> None:
    breaker, admitted = run(events)
    assert admitted == admissions
    assert breaker.state is state
    assert breaker.degraded is (state is not CLOSED)


def test_opens_counts_each_opening() -> None:
    breaker, _ = run(fails(3) + [("admit", 1.0), ("fail", 1.0, 3), ("admit", 3.0), ("ok", 3.0, 4)])
    assert breaker.opens == 2 and breaker.state is CLOSED


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"failure_threshold": True}, {"open_s": 0},
                                    {"open_s": float("inf")}, {"open_s": 2.0, "max_open_s": 1.0},
                                    {"max_open_s": float("nan")}], ids=str)
def test_bad_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)
