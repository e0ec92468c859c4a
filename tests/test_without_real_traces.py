"""Issue 27, item 6: the real traces are outside the repository (by licence); the README says where
each comes from, and the demo, the simulator and the tests work without them.

"Without them" is made two ways: `sim.real_traces.SHARED_DATA_DIR` pointed at a folder that does
not exist (in process), and a copy of this checkout in a temporary folder, with no
``../shared/data`` beside it, whose trace tests run in a child pytest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.commands.cli import app
from gateway.commands.demo import workload as demo_workload
from sim import real_traces
from sim.real_traces import REAL_TRACES
from sim.workloads import WORKLOADS, build_workload
from tests.deployment_support import ROOT, parse_cli
from tests.support.checkout_copy import copy_checkout, run_in_copy

FLEET = ROOT / "config" / "fleets" / "heterogeneous.yaml"
TRACE_TESTS = {  # the tests of these two files that read a real trace (the real_trace fixture)
    "tests/unit/sim/test_traces.py::test_mooncake_real_trace", "tests/unit/sim/test_traces.py::test_mooncake_limit",
    "tests/unit/sim/test_traces.py::test_azure_real_traces[code]",
    "tests/unit/sim/test_traces.py::test_azure_real_traces[conv]",
    "tests/unit/sim/test_traces.py::test_azure_code_first_rows", "tests/unit/sim/test_traces.py::test_sharegpt_real_file",
    "tests/unit/sim/test_workloads_sessions.py::test_azure_workload_is_the_real_trace_without_prefixes",
    "tests/unit/sim/test_workloads_sessions.py::test_real_mooncake_workload",
}


@pytest.fixture
def no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    absent = tmp_path / "shared" / "data"
    monkeypatch.setattr(real_traces, "SHARED_DATA_DIR", absent)
    return absent


def readme_real_traces() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("### Real traces\n")
    return text[start:text.index("\n## ", start)]


def test_the_readme_says_where_each_real_trace_comes_from_and_its_licence() -> None:
    section = readme_real_traces()
    for name, trace in REAL_TRACES.items():
        row = next((line for line in section.splitlines() if f"`{trace.relative.as_posix()}`" in line), None)
        assert row is not None, f"{name}: no row for {trace.relative}"
        assert trace.repository in row or "the same repository" in row, f"{name}: source repository"
        assert trace.source_path in row and trace.licence.split(" ")[0] in row, f"{name}: source path, licence"
        assert not trace.stand_in or f"`--workload {trace.stand_in}`" in row, f"{name}: stand-in"
    for flag in ("demo --trace PATH", "sim --trace PATH", "replay PATH", "../shared/data/"):
        assert flag in section


def test_every_real_workload_has_a_source_and_a_generated_stand_in() -> None:
    real = {name for name, w in WORKLOADS.items() if w.real}
    assert real and real <= REAL_TRACES.keys()
    for trace in REAL_TRACES.values():
        assert not trace.stand_in or not WORKLOADS[trace.stand_in].real


def test_without_the_data_the_generated_workloads_build_and_the_real_ones_say_where_to_get_them(no_data: Path) -> None:
    for name, workload in WORKLOADS.items():
        if not workload.real:
            assert len(build_workload(name, 30, seed=1)) == 30, name
            continue
        trace = REAL_TRACES[name]
        with pytest.raises(FileNotFoundError) as raised:
            build_workload(name, 30)
        message = str(raised.value)
        assert str(no_data / trace.relative) in message and "not in the repository" in message
        assert trace.repository in message and trace.source_path in message and trace.licence in message
        assert f"--workload {trace.stand_in}" in message and "--trace PATH" in message


def test_without_the_data_sim_runs_a_generated_workload_and_refuses_a_real_one(no_data: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(app, ["sim", "--fleet", str(FLEET), "--workload", "mooncake", "--limit", "20"])
    assert refused.exit_code == 2
    flat = re.sub(r"[\s│╭╮╰╯─]+", " ", refused.output)  # the usage-error box wraps the message
    assert REAL_TRACES["mooncake"].repository in flat and "--workload mooncake-like" in flat, refused.output
    ran = runner.invoke(app, ["sim", "--fleet", str(FLEET), "--workload", "mooncake-like", "--limit", "40",
                              "--policies", "kappa", "--json"])
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.output)
    assert report["run"]["requests"] == 40 and report["policies"]["kappa"]["finished"] == 40


def test_without_the_data_the_demo_generates_its_load_and_refuses_an_absent_trace(no_data: Path) -> None:
    requests = demo_workload(50, None, 2.5, 0)
    assert len(requests) == 50 and requests[0].hash_ids  # Mooncake-like: prefix blocks, generated
    absent = no_data / REAL_TRACES["mooncake"].relative
    with pytest.raises(Exception, match="does not exist"):
        parse_cli(["kappa-gateway", "demo", "--trace", str(absent)])


def test_in_a_checkout_without_the_data_the_trace_tests_skip_saying_where_to_get_it(tmp_path: Path) -> None:
    tree = copy_checkout(tmp_path / "checkout")
    assert not (tree.parent / "shared").exists()
    result = run_in_copy(tree, "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/unit/sim/test_traces.py",
                         "tests/unit/sim/test_workloads_sessions.py", env={"KAPPA_PURE_PYTHON": "1"})
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(rf"\d+ passed, {len(TRACE_TESTS)} skipped", summary), summary
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("not in the repository" in line and "https://github.com/" in line for line in skips), skips
    collected = run_in_copy(tree, "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                            "tests/unit/sim/test_traces.py", "tests/unit/sim/test_workloads_sessions.py",
                            env={"KAPPA_PURE_PYTHON": "1"})
    assert TRACE_TESTS <= set(collected.stdout.splitlines()), collected.stdout[-2000:]
