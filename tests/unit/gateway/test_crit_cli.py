"""``kappa-gateway crit`` reproduces REFERENCE.md §1 through the real console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from fleet_config.catalog import CONFIG_DIR, default_catalog
from gateway.commands.cli import app
from router import kappa

CATALOG = default_catalog()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kappa-gateway")
    cmd = [exe, *args] if exe else [sys.executable, "-c", "from gateway.commands.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_issue_example_llama_70b_on_h100() -> None:
    proc = run_cli("crit", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--kappa-hw", "34e-6", "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["model"] == "llama-3.1-70b" and row["hardware"] == "h100-sxm"
    assert row["b_kv_bytes"] == 327_680
    assert 14.3 <= round(row["kappa_crit_linear"], 1) <= 14.6  # the issue: "≈ 14.3–14.6"
    assert row["kappa_hw"] == 34e-6 and row["kappa_m"] == pytest.approx(430_603, rel=1e-4)


def test_all_models_all_hardware_json_shape() -> None:
    proc = run_cli("crit", "--json")
    rows = json.loads(proc.stdout)
    assert len(rows) >= 81
    assert {"model", "hardware", "b_kv_bytes", "kappa_m", "kappa_hw", "kappa_crit_linear"} <= set(rows[0])


def test_paper_values_with_kappa_hw_override() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(
        app, ["crit", "-m", "llama-3.1-70b", "-m", "qwen3-235b-a22b", "-m", "deepseek-v3", "-w", "h100-sxm",
              "--kappa-hw", "34e-6", "--json"])
    crit = {r["model"]: r["kappa_crit_linear"] for r in json.loads(result.stdout)}
    assert crit["llama-3.1-70b"] == pytest.approx(14.3, rel=0.05)
    assert crit["qwen3-235b-a22b"] == pytest.approx(7.8, rel=0.05)
    assert crit["deepseek-v3"] == pytest.approx(36, rel=0.05)


def test_link_and_compute_overrides_and_attention_aware_t() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(
        app, ["crit", "-m", "llama-3.1-70b", "-w", "h100-sxm", "--link-gbps", "34", "--c-eff-tflops", "1000",
              "--new-tokens", "2048", "--json"])
    (row,) = json.loads(result.stdout)
    assert row["kappa_hw"] == pytest.approx(34e-6)
    assert row["kappa_crit"] == pytest.approx(33.7, rel=0.01)  # at T: the request's
    assert row["kappa_crit_linear"] == pytest.approx(430_603 * 34e-6, rel=1e-4)  # the backend's, beside it
    (no_t,) = json.loads(CliRunner().invoke(app, ["crit", "-m", "llama-3.1-70b", "-w", "h100-sxm", "--json"]).stdout)
    assert "kappa_crit" not in no_t and "uncached_prompt_tokens" not in no_t  # no T, no per-request figure


def test_never_transfer_bound_is_null_in_json() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["crit", "-m", "llama-3.1-70b", "-w", "h100-sxm", "--kappa-hw", "34e-6", "-T", "4000", "--json"])
    assert json.loads(result.stdout)[0]["kappa_crit"] is None


def test_table_output_and_unknown_model_error() -> None:
    ok = run_cli("crit", "-m", "llama-3.1-8b", "-w", "b200")
    assert ok.returncode == 0 and "llama-3.1-8b" in ok.stdout and "131,072" in ok.stdout
    bad = run_cli("crit", "-m", "gpt-5")
    assert bad.returncode == 2 and "unknown model 'gpt-5'" in bad.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--link-gbps", "0"], "--link-gbps must be > 0"), (["--c-eff-tflops", "-1"], "--c-eff-tflops must be > 0"),
     (["--kappa-hw", "0"], "--kappa-hw must be > 0"), (["--kappa-hw", "34e-6", "--link-gbps", "40"], "not both")],
    ids=["zero-link", "negative-compute", "zero-kappa-hw", "conflicting-overrides"],
)
def test_bad_overrides_are_usage_errors(args: list[str], message: str) -> None:
    proc = run_cli("crit", "-m", "llama-3.1-8b", "-w", "h100-sxm", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_backend_of_the_demo_fleet_gets_the_kappa_crit_of_the_link_its_load_crosses() -> None:
    """The issue's GH200: 290.26 in /v1/kappa/backends, "never" from ``crit -T 1024``, ~25 in the
    headers. Three different figures, now each named: kappa_crit_linear (290.26, T-independent),
    and the request's kappa_crit at T=1024 — never from the host tier over NVLink-C2C (1.2 TB/s
    for the x4), 45.2 for a load from the fleet's KV pool (100 GB/s into the x4)."""
    from typer.testing import CliRunner

    def rows(*args: str) -> list[dict]:
        result = CliRunner().invoke(app, ["crit", "--config", str(CONFIG_DIR / "fleet.local.yaml"), "-b", "gh200",
                                          "-T", "1024", *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    (host,) = rows("--cached-host-tokens", "4096")
    (pool,) = rows("--cached-kv-pool-tokens", "4096", "--cached-hbm-tokens", "0")
    assert host["kappa_crit_linear"] == pool["kappa_crit_linear"] == pytest.approx(290.26, abs=0.01)
    assert host["kappa_crit"] is None and host["regime"] == "compute" and host["link_gb_s"] == 1200
    c_eff = pool["c_eff_tflops"] * 1e12
    assert pool["kv_pool_link_gb_s"] == 100 and pool["kappa_crit"] == pytest.approx(
        kappa.kappa_crit(CATALOG.model("llama-3.1-70b"), kappa.kappa_hw(100e9, c_eff), uncached_prompt_tokens=1024))
    assert pool["kappa_crit"] == pytest.approx(45.2, abs=0.05)
    assert (pool["kappa_ratio"], pool["kappa_ratio_loaded"], pool["regime"]) == (4.0, 4.0, "compute")
    (hbm,) = rows("--cached-hbm-tokens", "20000", "--cached-kv-pool-tokens", "4096")
    assert hbm["kappa_ratio"] == pytest.approx(24096 / 1024) and hbm["kappa_ratio_loaded"] == 4.0
    assert hbm["kappa_crit"] > pool["kappa_crit"]  # attention over the HBM-resident K is compute too


@pytest.mark.parametrize(
    ("args", "message"),
    [(["-b", "gh200"], "--backend needs -T"), (["-T", "10", "--cached-host-tokens", "5"], "need --backend"),
     (["-b", "nope", "-T", "10"], "unknown backend 'nope'"), (["-b", "gh200", "-T", "10", "-m", "qwen3-8b"], "--backend reads model")],
    ids=["backend-without-t", "split-without-backend", "unknown-backend", "backend-and-model"],
)
def test_backend_mode_usage_errors(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["crit", "--config", str(CONFIG_DIR / "fleet.local.yaml"), *args],
                                terminal_width=200)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_measured_figures_beside_the_profiles(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A saved /v1/kappa/backends answer whose H100 host link took 4× its profile's time: ``--measured``
    adds a row priced at it (a 4 × 15 GB/s link reads 15 GB/s, κ_crit_linear a quarter) and says so."""
    from typer.testing import CliRunner

    saved = tmp_path / "backends.json"
    factors = {"compute": {"time_ratio": 1.0, "ci": [0.99, 1.01], "requests": 40, "evidence_requests": 40.0},
               "host_link": {"time_ratio": 4.0, "ci": [3.5, 4.6], "requests": 6, "evidence_requests": 6.0},
               "kv_pool_link": {"evidence": "none"}, "hbm": {"evidence": "none"}}
    saved.write_text(json.dumps({"backends": [{"id": "h100-capped", "kappa_fit": {"factors": factors}}]}))
    args = ["crit", "--config", str(CONFIG_DIR / "fleet.local.yaml"), "--backend", "h100-capped", "-T", "1024",
            "--cached-host-tokens", "20000", "--measured", str(saved)]
    profile, measured = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert (profile["source"], measured["source"], measured["measured"]) == ("profile", "measured",
                                                                            ["compute", "host_link"])
    assert profile["link_gb_s"] == pytest.approx(60.0) and measured["link_gb_s"] == pytest.approx(15.0)
    assert measured["kappa_crit_linear"] == pytest.approx(profile["kappa_crit_linear"] / 4)
    assert measured["c_eff_tflops"] == pytest.approx(profile["c_eff_tflops"])
    text = CliRunner().invoke(app, args).stdout
    assert "h100-capped: its host_link takes 4× the time its profile says" in text
