"""``kappa-gateway demo`` beside a baseline, and two runs with one seed (issue 27, item 1).

Real runs of the demo at a small size: the four mocks of ``config/fleet.local.yaml`` and the
gateway as child processes on free loopback ports, the built-in generator replayed through real
HTTP, a fresh fleet per run. About 15 s of wall time per run of 60 requests and 30 s per run of 150,
four runs in all.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gateway.commands.cli import app
from gateway.commands.demo import run_demo
from gateway.commands.demo_compare import RepeatTolerance, repeat_spread, repeat_tolerance, within_tolerance
from gateway.commands.demo_report import print_report, tolerance_line

pytestmark = pytest.mark.integration

REQUESTS = 60  # every backend serves requests under κ at seed 0 (8 or more each: bench/results/demo_repeat.json)
REPEATED_REQUESTS = 150  # the smallest size held to the tighter TTFT bound (demo_compare.SMALL_RUN_REQUESTS)
FIGURES = {"requests", "errors", "ttft_p50_s", "ttft_p90_s", "e2e_p90_s", "itl_p50_s", "prefix_hit_ratio",
           "transfer_share", "energy_j", "energy_per_request_j", "backend_requests"}


@pytest.mark.timeout(240)
def test_demo_json_has_the_baseline_beside_kappa_and_the_ratios() -> None:
    """``demo --json``: a ``baseline`` section (its policy, the same figures as the κ run's, from its
    own fresh fleet) and ``kappa_vs_baseline`` = κ's figure over the baseline's."""
    result = CliRunner().invoke(app, ["demo", "--json", "-n", str(REQUESTS), "--seed", "0"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.stdout)
    base = report["baseline"]
    assert (report["policy"], base["policy"]) == ("kappa", "round-robin")
    assert set(report["figures"]) == set(base["figures"]) == FIGURES
    assert report["figures"]["requests"] == base["figures"]["requests"] == REQUESTS
    assert report["figures"]["errors"] == base["figures"]["errors"] == 0
    assert {b["id"] for b in base["backends"]} == {b["id"] for b in report["backends"]}
    for key, figure in (("ttft_p90", "ttft_p90_s"), ("e2e_p90", "e2e_p90_s")):
        assert report["kappa_vs_baseline"][key] == pytest.approx(report["figures"][figure] / base["figures"][figure])
    # the baseline really routed round-robin: a quarter each, give or take the turns a capacity filter skipped
    split = base["figures"]["backend_requests"]
    assert max(split.values()) - min(split.values()) <= 4, split
    assert base["figures"]["transfer_share"] is not None  # the gateway labels every answer, whatever the policy
    assert report["repeat_tolerance"] == repeat_tolerance(REQUESTS).as_dict() and "transfer_share" in report["definitions"]


@pytest.mark.timeout(300)
def test_two_runs_with_one_seed_agree_within_the_printed_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    """Same seed, same arrivals and prompts, fresh fleets: the per-backend split, TTFT and E2E p90 and
    J/request agree within the tolerance the report prints (`repeat_tolerance` for the run's size)."""
    first, second = (run_demo(requests=REPEATED_REQUESTS, seed=0, baseline=None, progress=False) for _ in range(2))
    printed_tolerance = first["repeat_tolerance"]
    assert printed_tolerance == second["repeat_tolerance"] == repeat_tolerance(REPEATED_REQUESTS).as_dict()
    spread = repeat_spread(first["figures"], second["figures"])
    splits = first["figures"]["backend_requests"], second["figures"]["backend_requests"]
    assert not within_tolerance(spread, RepeatTolerance(**printed_tolerance)), (spread, splits)
    capsys.readouterr()
    print_report(first, Console(width=300))
    assert " ".join(tolerance_line(printed_tolerance).split()) in " ".join(capsys.readouterr().out.split())
    assert first["baseline"] is None and first["kappa_vs_baseline"] is None
