"""The demo on a P/D fleet: a hit ratio that does not count pulled KV, prefill roles' placement, the
config it ran, its wall-time estimate and the repeat tolerance's provenance (pure functions, fast)."""

from __future__ import annotations

import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from gateway.commands.demo import wall_estimate_s
from gateway.commands.demo_compare import kappa_vs_baseline, repeat_tolerance
from gateway.commands.demo_figures import DEFINITIONS, build_report
from gateway.commands.demo_pd import LOCAL_COMPUTE, NIXL_BYTES, since
from gateway.commands.demo_report import AGGREGATED_ONLY, print_report, tolerance_line
from gateway.commands.replay import RequestResult
from router import kappa

SETTINGS = load_settings(CONFIG_DIR / "fleet.local.yaml", default_catalog(), env={})
PD_SETTINGS = load_settings(CONFIG_DIR / "fleet.pd.local.yaml", default_catalog(), env={})
B_KV = kappa.b_kv_bytes(PD_SETTINGS.backend_spec(default_catalog(), PD_SETTINGS.backends[0]).model)


def answer(i: int, prefill: str | None, decode: str, cached: int, prompt: int = 9_000) -> RequestResult:
    return RequestResult(index=i, arrival_s=0.0, sent_s=0.0, status=200, ttft_s=0.1, e2e_s=2.0, itl_s=0.02,
                         prompt_tokens=prompt, cached_tokens=cached, backend=decode, prefill_backend=prefill,
                         regime="compute")


# Three splits, each decode reporting P − 1 cached (pulled KV, vLLM's convention), and one whole request.
PD_RESULTS = [answer(0, "b200-p0", "h100-d0", 8_999), answer(1, "b200-p0", "h100-d0", 8_999),
              answer(2, "b200-p1", "h100-d1", 8_999), answer(3, None, "gh200", 0)]
# What the backends computed: b200-p0 prefilled 9,000 then 1,000 (its second prompt found 8,000 in its
# cache), b200-p1 9,000, gh200 9,000; each split decode recomputed its last token; the decodes pulled 17,000 tokens.
PD_METRICS = {"b200-p0": {LOCAL_COMPUTE: 10_000.0}, "b200-p1": {LOCAL_COMPUTE: 9_000.0}, "gh200": {LOCAL_COMPUTE: 9_000.0},
              "h100-d0": {LOCAL_COMPUTE: 2.0, NIXL_BYTES: 8_000 * B_KV},
              "h100-d1": {LOCAL_COMPUTE: 1.0, NIXL_BYTES: 9_000 * B_KV}}


def printed(report: dict, capsys: pytest.CaptureFixture[str]) -> str:
    report.setdefault("wall_s", 1.0)
    report.setdefault("workload", "hand-made")
    print_report(report, Console(width=300))
    return " ".join(capsys.readouterr().out.split())


def test_a_split_requests_pulled_kv_is_not_a_cache_hit() -> None:
    report = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0)
    figures = report["figures"]
    # usage would say 3 × 8,999 / 36,000 = 75%; the fleet prefilled 28,000 of 36,000 prompt tokens
    assert figures["prefix_hit_ratio"] == pytest.approx(8_000 / 36_000)
    assert figures["kv_transferred_tokens"] == 17_000
    by_id = {b["id"]: b["prefix_hit_ratio"] for b in report["backends"]}
    assert by_id["b200-p0"] == pytest.approx(8_000 / 18_000) and by_id["b200-p1"] == 0.0 and by_id["gh200"] == 0.0
    assert by_id["h100-d0"] is None  # it prefilled nothing: decodes alone
    json.dumps(report, allow_nan=False)


def test_a_pd_run_without_scraped_counters_leaves_the_hit_unknown() -> None:
    figures = build_report(PD_SETTINGS, PD_RESULTS, {}, {}, time_scale=1.0)["figures"]
    assert figures["prefix_hit_ratio"] is None and figures["kv_transferred_tokens"] is None


def test_an_aggregated_fleets_hit_ratio_is_still_the_answers_usage() -> None:
    results = [answer(0, None, "b200-a", 500, 2_000), answer(1, None, "gh200", 9_800, 10_000)]
    counters = {"b200-a": {LOCAL_COMPUTE: 99_999.0}, "gh200": {LOCAL_COMPUTE: 99_999.0}}  # not read here
    figures = build_report(SETTINGS, results, counters, {}, time_scale=1.0)["figures"]
    assert figures["prefix_hit_ratio"] == pytest.approx(10_300 / 12_000)
    assert "kv_transferred_tokens" not in figures  # the aggregated demo's figures are as they were


def test_only_the_run_counters_are_taken_since_the_run_began() -> None:
    before = {LOCAL_COMPUTE: 10.0, NIXL_BYTES: 5.0, "mock_vllm:energy_joules_total": 100.0}
    after = {LOCAL_COMPUTE: 110.0, NIXL_BYTES: 5.0, "mock_vllm:energy_joules_total": 300.0}
    assert since(after, before) == {LOCAL_COMPUTE: 100.0, NIXL_BYTES: 0.0, "mock_vllm:energy_joules_total": 300.0}


def test_the_legend_defines_the_pd_hit_and_the_transferred_kv_once(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0)
    text = printed(report, capsys)
    for key in ("prefix_hit_ratio", "prefix_hit_ratio_pd", "kv_transferred_tokens"):
        assert text.count(" ".join(DEFINITIONS[key].split())) == 1, key
    assert "KV moved between backends is not a hit" in DEFINITIONS["prefix_hit_ratio_pd"]


def test_a_prefill_role_that_prefilled_is_not_idle(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0)
    assert report["placement_by_role"]["compute-dense"]["prefills"] == 3
    text = printed(report, capsys)
    assert "compute-dense prefilled 3 split requests (decoded elsewhere)" in text
    assert "compute-dense idle" not in text and "b200-p0 prefilled 2, decoded none" in text


def test_the_next_line_names_the_config_the_demo_ran(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0)
    report["config"] = "config/fleet.pd.local.yaml"
    text = printed(report, capsys)
    assert "`kappa-gateway mock-fleet --config config/fleet.pd.local.yaml`" in text
    assert "config/fleet.local.yaml`" not in text


def test_the_wall_time_estimate_scales_with_the_requests() -> None:
    default = wall_estimate_s(400, 2.5, 1.0, 0.4, runs=2)
    assert 120 <= default <= 180  # the default demo: about two and a half minutes
    assert wall_estimate_s(40, 2.5, 1.0, 0.4, runs=2) < default / 3
    assert wall_estimate_s(4_000, 2.5, 1.0, 0.4, runs=1) > default


def test_on_a_pd_fleet_the_tolerance_says_it_was_measured_on_the_aggregated_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    tolerance = repeat_tolerance(40).as_dict()
    assert tolerance_line(tolerance, pd=True).startswith(AGGREGATED_ONLY)
    assert AGGREGATED_ONLY not in tolerance_line(tolerance)
    report = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0)
    base = build_report(PD_SETTINGS, PD_RESULTS, PD_METRICS, {}, time_scale=1.0) | {"wall_s": 1.0}
    report.update(repeat_tolerance=tolerance, baseline=base,
                  kappa_vs_baseline=kappa_vs_baseline(report["figures"], base["figures"]))
    text = printed(report, capsys)
    assert " ".join(AGGREGATED_ONLY.split()) in text
    assert re.search(r"KV transferred \(tokens\)\W+17,000\W+17,000\W", text)


def test_demo_help_lists_every_baseline_policy() -> None:
    from gateway.commands.cli import app

    out = " ".join(CliRunner().invoke(app, ["demo", "--help"], terminal_width=400).output.split())
    for name in ("kappa-aggregated", "pd-always", "pd-llmd", "pd-dynamo", "config/fleet.pd.local.yaml"):
        assert name in out, name
