"""`bench/faults_probe.py`'s arithmetic: the added p50 per window, the phases, the time back to normal.

Synthetic probe samples every 50 ms on a bench clock: index probes take 10 ms, control
probes 5 ms, and each case adds a fault's extra latency to the index probes somewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def probe(request: pytest.FixtureRequest):
    """`bench/faults_probe.py`, imported the way `python bench/faults.py` sees it."""
    sys.path.insert(0, str(BENCH_DIR))
    request.addfinalizer(lambda: sys.path.remove(str(BENCH_DIR)))
    import faults_probe

    return faults_probe


T0, RESUME, END = 10.0, 15.0, 20.0


def samples(probe, extra_s, *, machine_noise_s=lambda t: 0.0, gap=None):
    """Index and control probes from 0 to END every 50 ms; ``extra_s(t)`` is added to the index
    probes only, ``machine_noise_s(t)`` to both; none are sent in ``gap`` (lo, hi)."""
    out = []
    for i in range(int(END / 0.05)):
        t = i * 0.05
        if gap and gap[0] <= t < gap[1]:
            continue
        out.append(probe.Sample("index", t, 0.010 + extra_s(t) + machine_noise_s(t), True))
        out.append(probe.Sample("control", t + 0.01, 0.005 + machine_noise_s(t), True))
    return out


CASES = [
    # (name, extra on index probes, machine noise, gap, p50_back_s, phase "first_1s", phase "rest_of_fault")
    ("no effect", lambda t: 0.0, lambda t: 0.0, None, 0.0, 0.0, 0.0),
    ("half a second of timeouts, then skipped", lambda t: 0.05 if T0 <= t < T0 + 0.5 else 0.0, lambda t: 0.0, None,
     0.5, 25.0, 0.0),
    ("timeouts for the whole fault", lambda t: 0.05 if T0 <= t < RESUME else 0.0, lambda t: 0.0, None,
     None, 50.0, 50.0),
    ("machine noise hits both kinds: not the fault's", lambda t: 0.0, lambda t: 0.03 if 11 <= t < 13 else 0.0, None,
     0.0, 0.0, 0.0),
    ("a window with no probe sent counts as not back", lambda t: 0.0, lambda t: 0.0, (12.0, 12.3), 2.25, 0.0, 0.0),
]


@pytest.mark.parametrize(("extra", "noise", "gap", "back_s", "first_1s", "rest"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_probe_report(probe, extra, noise, gap, back_s, first_1s, rest) -> None:
    report = probe.probe_report(samples(probe, extra, machine_noise_s=noise, gap=gap), 0.0, T0, RESUME, END)
    assert report["normal_p50_ms"] == {"index": 10.0, "control": 5.0}
    assert report["p50_back_s"] == back_s
    assert report["phases"]["first_1s"] == pytest.approx(first_1s)
    assert report["phases"]["rest_of_fault"] == pytest.approx(rest)
    assert report["phases"]["before"] == report["phases"]["later"] == 0.0
    assert [w["t_s"] for w in report["windows"][:2]] == [-2.0, -1.75]
    assert len(report["windows"]) == (END - T0 + 2.0) / 0.25


def test_no_pre_fault_samples_give_no_report(probe) -> None:
    report = probe.probe_report([], 0.0, T0, RESUME, END)
    assert report["windows"] == [] and report["p50_back_s"] is None
