"""Two demo runs side by side: κ over a baseline (`kappa_vs_baseline`), and how far two runs of
one policy with one seed may differ (`repeat_tolerance`, `repeat_spread`).

Both take `gateway.commands.demo_figures.run_figures` dicts. The runs replay the same requests
(one seed: the same arrivals and prompts), each on a fresh mock fleet and gateway, so every
difference between two runs of one policy is live timing: the mocks step on the wall clock,
the gateway's scrapes and health checks land at other moments, so a decision that sees the
load a little differently sends a request elsewhere, and the caches differ from then on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

RATIO_FIGURES = {"ttft_p50": "ttft_p50_s", "ttft_p90": "ttft_p90_s", "e2e_p90": "e2e_p90_s", "itl_p50": "itl_p50_s",
                 "prefix_hit_ratio": "prefix_hit_ratio", "transfer_share": "transfer_share",
                 "energy_per_request": "energy_per_request_j"}
"""``kappa_vs_baseline`` key → the `run_figures` figure it divides."""


@dataclass(frozen=True)
class RepeatTolerance:
    """How far two runs of one policy with one seed may differ and still count as the same.

    Attributes:
        min_requests, max_requests: the run sizes it holds for, requests (``max_requests`` None:
            no upper end).
        backend_share: the largest per-backend difference in the share of successful requests
            served, as a fraction of the run's requests, [0,1].
        backend_slack_requests: added to ``backend_share × requests`` before comparing counts, so
            that a small run is not held to a fraction of one request, requests.
        ttft_p90_relative: the larger TTFT p90 over the smaller, minus 1.
        e2e_p90_relative: the larger E2E p90 over the smaller, minus 1.
        energy_per_request_relative: the larger J/request over the smaller, minus 1.

    The measured bounds and their derivation: `REPEAT_TOLERANCES`.
    """

    min_requests: int
    max_requests: int | None
    backend_share: float
    backend_slack_requests: int
    ttft_p90_relative: float
    e2e_p90_relative: float
    energy_per_request_relative: float

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


SMALL_RUN_REQUESTS = 150
"""Below this many requests a run's TTFT p90 rests on its few slowest requests (6 of 60): see `REPEAT_TOLERANCES`."""
REPEAT_TOLERANCES = (
    RepeatTolerance(min_requests=1, max_requests=SMALL_RUN_REQUESTS - 1, backend_share=0.15, backend_slack_requests=3,
                    ttft_p90_relative=0.65, e2e_p90_relative=0.15, energy_per_request_relative=0.05),
    RepeatTolerance(min_requests=SMALL_RUN_REQUESTS, max_requests=None, backend_share=0.15, backend_slack_requests=3,
                    ttft_p90_relative=0.40, e2e_p90_relative=0.15, energy_per_request_relative=0.05),
)
"""Measured (bench/demo_repeat.py, bench/results/demo_repeat.json): the κ demo with seed 0 on fresh
fleets, every pair of runs, on the 2-core machine with nothing else running. Largest (median)
spread: at 60 requests (16 runs, 120 pairs) 4 (1) requests on a backend, TTFT p90 +48% (+9%), E2E
p90 +11% (+1%), J/request +1.5%; at 150 (5 runs) 5 (0) requests, TTFT p90 +0.9%, E2E p90 +5.8%,
J/request +1.1%; at 400 (11 runs, 55 pairs) 43 (22) requests = 10.7% (5.5%), TTFT p90 +25% (+8%),
E2E p90 +10% (+4%), J/request +1.9% (and one more demo run, its figures printed only, at TTFT p90
2.67 s: +30% over the lowest). round-robin, 5 runs of 60: the same split every time, TTFT
p90 within 0.6%. At 60 requests the runs fall on a few placements (the H100 serving 8 to 12),
whose TTFT p90 differ by up to a half: hence a looser TTFT bound below `SMALL_RUN_REQUESTS`. The bounds sit
at least 1.3× over the largest spread seen: 15% of the requests + 3 on a backend (the slack
covers a small run's granularity), TTFT p90 65% below 150 requests and 40% from there (measured
up to 400), E2E p90 15%, J/request 5%. Not bounded: TTFT p50 (+77% at 60, +30% at 400) and ITL
p50 (+8%, +3%), which spread more. κ decides on live load, so once one decision lands elsewhere
(a scrape a moment earlier, a mock step a little late) the caches, and later decisions, differ:
its runs spread far more than round-robin's. The prefix hit ratio never moved: with the fleet's
shared KV pool every backend finds every prefix, wherever it is sent."""


def repeat_tolerance(requests: int) -> RepeatTolerance:
    """The `REPEAT_TOLERANCES` entry for a run of ``requests`` requests (≥ 1)."""
    return next(t for t in REPEAT_TOLERANCES if t.max_requests is None or requests <= t.max_requests)


def relative_difference(a: float | None, b: float | None) -> float | None:
    """``max(a, b) / min(a, b) − 1`` for positive ``a``, ``b`` (0 when equal); None when either is missing
    or not positive. Symmetric: a ratio ``a / b`` lies in [1/(1+d), 1+d]."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return max(a, b) / min(a, b) - 1.0


def kappa_vs_baseline(kappa: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """κ's figure over the baseline's, for every `RATIO_FIGURES` key (below 1: κ's is lower).

    Args:
        kappa, baseline: `run_figures` of the two runs.

    Returns:
        ``{"ttft_p50", "ttft_p90", "e2e_p90", "itl_p50", "prefix_hit_ratio", "transfer_share",
        "energy_per_request"}`` → the ratio, or null where either figure is missing or the
        baseline's is 0.
    """
    out: dict[str, float | None] = {}
    for key, figure in RATIO_FIGURES.items():
        a, b = kappa.get(figure), baseline.get(figure)
        out[key] = a / b if a is not None and b else None
    return out


def repeat_spread(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How far two runs differ, in the terms of `RepeatTolerance`.

    Args:
        a, b: `run_figures` of two runs of the same requests.

    Returns:
        ``backend_share`` (largest per-backend difference in share of the run's requests),
        ``backend_requests`` (largest per-backend difference in requests), ``ttft_p90_relative``,
        ``e2e_p90_relative``, ``energy_per_request_relative`` (`relative_difference`; null when a
        figure is missing), and ``requests`` (the larger run's).
    """
    requests = max(a["requests"], b["requests"], 1)
    ids = set(a["backend_requests"]) | set(b["backend_requests"])
    counts = [abs(a["backend_requests"].get(i, 0) - b["backend_requests"].get(i, 0)) for i in ids]
    return {
        "requests": requests, "backend_requests": max(counts, default=0),
        "backend_share": max(counts, default=0) / requests,
        "ttft_p90_relative": relative_difference(a["ttft_p90_s"], b["ttft_p90_s"]),
        "e2e_p90_relative": relative_difference(a["e2e_p90_s"], b["e2e_p90_s"]),
        "energy_per_request_relative": relative_difference(a["energy_per_request_j"], b["energy_per_request_j"]),
    }


def within_tolerance(spread: dict[str, Any], tolerance: RepeatTolerance | None = None) -> list[str]:
    """The figures of `repeat_spread` outside ``tolerance`` (default: `repeat_tolerance` of the run's
    size), each as ``"<figure> <value> > <bound>"``; empty when the two runs agree. A missing figure
    is outside (nothing to agree on)."""
    tolerance = tolerance or repeat_tolerance(spread["requests"])
    problems = []
    bound = tolerance.backend_share * spread["requests"] + tolerance.backend_slack_requests
    if spread["backend_requests"] > bound:
        problems.append(f"backend_requests {spread['backend_requests']} > {bound:g}")
    for name in ("ttft_p90_relative", "e2e_p90_relative", "energy_per_request_relative"):
        value, limit = spread[name], getattr(tolerance, name)
        if value is None or value > limit:
            problems.append(f"{name} {value} > {limit:g}")
    return problems
