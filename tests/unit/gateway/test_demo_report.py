"""The demo's report from replay results (a pure function of results and scraped metrics)."""

from __future__ import annotations

import json
import re

import pytest
from rich.console import Console

from fleet_config.catalog import CONFIG_DIR, default_catalog
from gateway.commands.demo_figures import DEFINITIONS, SELF_CONSISTENCY, build_report
from gateway.commands.demo_report import print_report
from gateway.commands.replay import RequestResult
from fleet_config.settings import load_settings

SETTINGS = load_settings(CONFIG_DIR / "fleet.local.yaml", default_catalog(), env={})


def result(i: int, backend: str, kappa: float, prompt: int, cached: int, regime: str = "compute") -> RequestResult:
    return RequestResult(index=i, arrival_s=0.0, sent_s=0.0, status=200, ttft_s=0.1 * (i + 1), prompt_tokens=prompt,
                         cached_tokens=cached, backend=backend, kappa_ratio=kappa, regime=regime)


def test_report_counts_shares_and_converts_ttft_to_modelled_seconds() -> None:
    results = [
        result(0, "b200-a", 0.1, 30_000, 0),
        result(1, "b200-a", 0.2, 2_000, 500),
        result(2, "gh200", 50.0, 10_000, 9_800, "transfer"),
        result(3, "h100-capped", 20.0, 4_200, 4_000),
        RequestResult(index=4, arrival_s=0.0, sent_s=0.0, status=503, error="no backend"),
    ]
    report = build_report(SETTINGS, results, {"gh200": {"mock_vllm:energy_joules_total": 1234.0,
                                                        "mock_vllm:kv_pool_loaded_bytes_total": 5e9}},
                          {"gateway_cached_tokens_estimated_total": 14_000.0,
                           'gateway_index_predictions_total{outcome="within_one_block"}': 19.0,
                           'gateway_index_predictions_total{outcome="under"}': 1.0}, time_scale=0.5)
    assert (report["requests"], report["errors"], report["error_examples"]) == (5, 1, ["no backend"])
    by_id = {b["id"]: b for b in report["backends"]}
    assert by_id["b200-a"]["requests"] == 2 and by_id["b200-a"]["ttft_p50_s"] == pytest.approx(0.3)  # (0.1+0.2)/2/0.5
    assert by_id["gh200"]["regimes"] == {"compute": 0, "transfer": 1} and by_id["gh200"]["energy_j"] == 1234.0
    assert by_id["gh200"]["prefix_hit_ratio"] == pytest.approx(0.98)
    roles = report["placement_by_role"]
    assert roles["compute-dense"]["high_kappa_share"] == 0 and roles["bandwidth-rich"]["high_kappa_share"] == 1
    assert roles["compute-dense"]["large_t_share"] == 0.5  # the 30k-token cold prefill
    assert report["kv_pool_gb"] == SETTINGS.kv_pool.capacity_gb
    assert (by_id["gh200"]["kv_pool_loaded_bytes"], by_id["b200-a"]["kv_pool_loaded_bytes"]) == (5e9, None)
    assert report["index_within_one_block_share"] == 0.95
    assert report["index_predictions"] == {"within_one_block": 19, "over": 0, "under": 1}


def test_no_answers_with_usage_leave_the_share_unknown() -> None:
    report = build_report(SETTINGS, [], {}, {}, time_scale=1.0)
    assert report["index_within_one_block_share"] is None and report["index_resets"] == 0


def test_the_text_report_states_the_index_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    results = [result(0, "gh200", 50.0, 10_000, 9_800, "transfer")]
    report = build_report(SETTINGS, results, {}, {'gateway_index_predictions_total{outcome="within_one_block"}': 39.0,
                                                  'gateway_index_predictions_total{outcome="over"}': 1.0,
                                                  "gateway_index_resets_total": 2.0}, time_scale=1.0)
    report.update(wall_s=1.0, workload="test")
    print_report(report, Console(width=300))  # it prints at ≥ 160 columns on its own console
    assert ("predicted K within one block of the reported cached tokens on 97.5% of 40 answers (over: 1, under: 0); "
            "2 index resets") in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("modes", "kind"), [
    ({"b200-a": "exact", "b200-b": "exact", "gh200": "degraded", "h100-capped": "exact"},
     "Prefix index (exact, from the engines' KV events, on 3 of 4 backends):"),
    ({"b200-a": "approximate"}, "Prefix index (approximate):"),
    ({}, "Prefix index (approximate):"),
])
def test_the_text_report_names_the_index_mode(modes: dict, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Newcomer trial (issue 30): the report never said whether the index was fed by the engines' events."""
    report = build_report(SETTINGS, [result(0, "gh200", 50.0, 10_000, 9_800, "transfer")], {},
                          {'gateway_index_predictions_total{outcome="within_one_block"}': 1.0}, time_scale=1.0)
    report.update(wall_s=1.0, workload="test", index_modes=modes)
    print_report(report, Console(width=300))
    assert kind in " ".join(capsys.readouterr().out.split())


def test_transfer_share_is_each_backends_own_regime_not_one_kappa_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13, item 2: the table applied one `κ>6.4` column (the compute-dense κ_crit_linear) to
    every row. A GH200 request at κ_ratio 50 is compute-bound there (its κ_crit at that T is 200);
    a B200 request at κ_ratio_loaded 8 is transfer-bound (its κ_crit 7); an H100 request whose
    κ_ratio 10 is all HBM hit loads nothing. The column now counts the gateway's own regimes."""
    from rich.console import Console

    from gateway.commands.demo_report import print_report

    def routed(i: int, backend: str, ratio: float, loaded: float, crit: float, regime: str) -> RequestResult:
        return RequestResult(index=i, arrival_s=0.0, sent_s=0.0, status=200, ttft_s=0.1, prompt_tokens=9_000,
                             cached_tokens=8_000, backend=backend, kappa_ratio=ratio, kappa_ratio_loaded=loaded,
                             kappa_crit=crit, regime=regime)

    results = [routed(0, "gh200", 50.0, 50.0, 200.0, "compute"), routed(1, "gh200", 3.0, 3.0, float("inf"), "compute"),
               routed(2, "b200-a", 8.0, 8.0, 7.0, "transfer"), routed(3, "h100-capped", 10.0, 0.0, 25.0, "compute"),
               routed(4, "b200-b", 0.1, 0.0, float("inf"), "compute")]
    report = build_report(SETTINGS, results, {}, {}, time_scale=1.0)
    report.update(wall_s=1.0, workload="hand-made")
    by_id = {b["id"]: b for b in report["backends"]}
    assert {k: by_id[k]["transfer_share"] for k in ("gh200", "b200-a", "h100-capped", "b200-b")} == {
        "gh200": 0.0, "b200-a": 1.0, "h100-capped": 0.0, "b200-b": 0.0}
    assert (by_id["b200-b"]["kappa_crit_p50"], by_id["b200-b"]["kappa_crit_never_requests"]) == (None, 1)
    json.dumps(report, allow_nan=False)  # --json prints strict JSON: "never" is null, not Infinity
    assert by_id["gh200"]["kappa_crit_linear"] == pytest.approx(290.26, abs=0.01) and "kappa_crit" not in by_id["gh200"]
    assert by_id["gh200"]["kappa_crit_p50"] == 200.0 and by_id["gh200"]["kappa_ratio_loaded_p90"] == pytest.approx(45.3)
    assert by_id["h100-capped"]["kappa_ratio_p50"] == 10.0 and by_id["h100-capped"]["kappa_ratio_loaded_p50"] == 0.0

    print_report(report, Console(width=240))
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "backend" in line and "hardware" in line)
    assert "κ>" not in header and "transfer" in header and "κ_crit_lin" in header and "κ_load p90" in header
    rows = {line.split()[1]: line for line in text.splitlines() if line.split()[1:2] and line.split()[1] in by_id}
    assert "1 (100%)" in rows["b200-a"] and "0 (0%)" in rows["gh200"] and "290.3" in rows["gh200"]
    assert "never" in rows["b200-b"] and "200.0" in rows["gh200"]


# --- issue 27, item 5: a report an operator can reconcile -----------------------------------------

def routed(i: int, backend: str, ratio: float, loaded: float, crit: float, regime: str) -> RequestResult:
    return RequestResult(index=i, arrival_s=0.0, sent_s=0.0, status=200, ttft_s=0.1, e2e_s=2.0, itl_s=0.02,
                         prompt_tokens=9_000, cached_tokens=8_000, backend=backend, kappa_ratio=ratio,
                         kappa_ratio_loaded=loaded, kappa_crit=crit, regime=regime)


def printed(report: dict, capsys: pytest.CaptureFixture[str], *, lines: bool = False) -> str | list[str]:
    """The printed report: its words joined by single spaces, or (``lines``) its lines with the table
    borders dropped."""
    report.setdefault("wall_s", 1.0)
    report.setdefault("workload", "hand-made")
    print_report(report, Console(width=300))
    out = capsys.readouterr().out
    return [" ".join(line.replace("│", " ").split()) for line in out.splitlines()] if lines else " ".join(out.split())


GH200_MOSTLY_HBM = [  # high-κ everywhere, but K read in place from HBM: three compute-bound, one transfer-bound
    routed(0, "gh200", 40.0, 0.0, 210.0, "compute"), routed(1, "gh200", 30.0, 1.0, 200.0, "compute"),
    routed(2, "gh200", 20.0, 0.0, float("inf"), "compute"), routed(3, "gh200", 400.0, 390.0, 250.0, "transfer"),
    routed(4, "b200-a", 5.0, 5.0, 4.0, "transfer"), routed(5, "b200-b", 0.5, 0.0, float("inf"), "compute")]


def test_high_kappa_and_transfer_shares_are_defined_once_and_reconciled(capsys: pytest.CaptureFixture[str]) -> None:
    """GH200 read 4% transfer beside 29% high-κ and nothing said why. Each share is now printed with
    its one definition (the JSON's), exactly once, and per backend the high-κ requests stand beside
    the transfer-bound ones: 4 high-κ, 1 transfer-bound, 1 of them high-κ; b200-a's transfer-bound
    request is below the threshold."""
    report = build_report(SETTINGS, GH200_MOSTLY_HBM, {}, {}, time_scale=1.0)
    text = printed(report, capsys)
    for key in ("transfer_share", "high_kappa_share", "large_t_share"):
        assert text.count(" ".join(DEFINITIONS[key].split())) == 1, key
    by_id = {b["id"]: b for b in report["backends"]}
    assert (by_id["gh200"]["high_kappa_requests"], by_id["gh200"]["high_kappa_transfer_requests"]) == (4, 1)
    assert (by_id["b200-a"]["high_kappa_requests"], by_id["b200-a"]["regimes"]["transfer"]) == (0, 1)
    assert "gh200 4 of 4 high-κ (100%), 1 transfer-bound (25%; 1 of them high-κ)" in text
    assert "b200-a 0 of 1 high-κ (0%), 1 transfer-bound (100%; 0 of them high-κ)" in text
    assert "high-κ share / large-T share" in text and "high-κ (κ_ratio > 6.4" not in text.split("Legend")[0].split(
        "Placement by role")[1].split(".")[0]


def test_never_is_defined_in_the_legend(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(SETTINGS, GH200_MOSTLY_HBM, {}, {}, time_scale=1.0)
    text = printed(report, capsys)
    assert "never" in text.split("Placement by role")[0]  # b200-b's median request: x-kappa-crit inf
    assert " ".join(DEFINITIONS["never"].split()) in text and DEFINITIONS["never"].startswith("never = x-kappa-crit is inf")


def test_the_measured_kappa_crit_is_called_a_self_consistency_check_on_mocks(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(SETTINGS, GH200_MOSTLY_HBM, {}, {}, time_scale=1.0)
    report["kappa_crit_measured"] = {"gh200": {"value": 290.0, "ci": [288.0, 292.0], "load_requests": 4}}
    text = printed(report, capsys)
    line = text.split("Measured κ_crit")[1].split("Legend")[0]
    assert "gh200 290 [288, 292] from 4 load-bound requests" in line
    assert " ".join(SELF_CONSISTENCY.split()) in line and "self-consistency check" in SELF_CONSISTENCY


def test_an_idle_backend_reads_idle_never_nan_or_inf(capsys: pytest.CaptureFixture[str]) -> None:
    """h100-capped served nothing: its J/request and per-request figures are idle (null in JSON), not
    0, NaN or ∞, while its energy (idle draw) is still reported."""
    energy = {b.id: {"mock_vllm:energy_joules_total": 9_000.0} for b in SETTINGS.backends}
    report = build_report(SETTINGS, GH200_MOSTLY_HBM, energy, {}, time_scale=1.0)
    idle = next(b for b in report["backends"] if b["id"] == "h100-capped")
    assert idle["idle"] and idle["requests"] == 0 and idle["energy_j"] == 9_000.0
    assert all(idle[k] is None for k in ("energy_per_request_j", "transfer_share", "ttft_p90_s", "prefix_hit_ratio"))
    assert report["placement_by_role"]["power-capped"]["high_kappa_share"] is None
    gh200 = next(b for b in report["backends"] if b["id"] == "gh200")
    assert gh200["energy_per_request_j"] == 2_250.0 and not gh200["idle"]
    json.dumps(report, allow_nan=False)
    lines = printed(report, capsys, lines=True)
    row = next(line for line in lines if line.startswith("h100-capped"))
    assert row.split()[-12:] == ["idle"] * 12, row
    text = " ".join(lines)
    assert "power-capped idle" in text and "h100-capped idle" in text
    assert not re.search(r"\b(nan|inf|infinity)\b", text.split("Legend")[0], re.IGNORECASE)


# --- issue 26: the demo on a P/D fleet ----------------------------------------------------------

PD_SETTINGS = load_settings(CONFIG_DIR / "fleet.pd.local.yaml", default_catalog(), env={})


def split(i: int, prefill: str | None, decode: str) -> RequestResult:
    return RequestResult(index=i, arrival_s=0.0, sent_s=0.0, status=200, ttft_s=0.1, e2e_s=2.0, itl_s=0.02,
                         prompt_tokens=9_000, cached_tokens=8_999 if prefill else 0, backend=decode,
                         prefill_backend=prefill, regime="compute")


PD_RESULTS = [split(0, "b200-p0", "h100-d0"), split(1, "b200-p0", "h100-d0"), split(2, "b200-p1", "h100-d1"),
              split(3, None, "gh200"), RequestResult(index=4, arrival_s=0.0, sent_s=0.0, status=503, error="no backend")]


def test_a_pd_fleet_reports_kv_roles_the_split_share_and_splits_per_pair(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(PD_SETTINGS, PD_RESULTS, {}, {"gateway_pd_splits_total": 3.0}, time_scale=1.0)
    assert report["pd"] == {
        "splits": 3, "split_share": 0.75, "splits_counted_by_gateway": 3.0, "prefill_fallbacks": 0,
        "pairs": [{"prefill_backend": "b200-p0", "decode_backend": "h100-d0", "splits": 2},
                  {"prefill_backend": "b200-p1", "decode_backend": "h100-d1", "splits": 1}]}
    by_id = {b["id"]: b for b in report["backends"]}
    assert {k: (b["kv_role"], b["prefills"], b["requests"]) for k, b in by_id.items()} == {
        "b200-p0": ("prefill", 2, 0), "b200-p1": ("prefill", 1, 0), "gh200": ("both", 0, 1),
        "h100-d0": ("decode", 0, 2), "h100-d1": ("decode", 0, 1)}
    json.dumps(report, allow_nan=False)
    lines = printed(report, capsys, lines=True)
    text = " ".join(" ".join(lines).split())
    assert "split share 75.0% (the gateway counted 3 in gateway_pd_splits_total)" in text
    assert "Splits per (prefill → decode): b200-p0 → h100-d0 2, b200-p1 → h100-d1 1." in text
    header = next(line for line in lines if "backend" in line and "hardware" in line)
    assert "hardware ┃ kv_role ┃ prefills ┃ κ_crit_lin" in header
    assert next(line for line in lines if line.startswith("b200-p0 ")).split()[3:5] == ["prefill", "2"]
    for key in ("kv_role", "split_share", "splits_per_pair"):
        assert text.count(" ".join(DEFINITIONS[key].split())) == 1, key


def test_an_aggregated_fleet_has_no_pd_section(capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(SETTINGS, GH200_MOSTLY_HBM, {}, {}, time_scale=1.0)
    assert report["pd"] is None and {b["kv_role"] for b in report["backends"]} == {"both"}
    text = printed(report, capsys)
    assert "kv_role" not in text and "split share" not in text and "P/D" not in text
