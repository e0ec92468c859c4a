"""``kappa-gateway demo --config config/fleet.pd.local.yaml`` (issue 26): the demo's run on the local P/D
fleet — five mocks speaking vLLM's NixlConnector protocol and the gateway as child processes on free
loopback ports — splits requests and its report says how many, over which pairs, and each backend's
kv_role. Few requests with short answers at a small time scale: about 10 s of wall time.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from gateway.commands.demo import on_free_ports, run_policy
from gateway.commands.demo_report import print_report
from sim.workloads.mooncake_like import mooncake_like

pytestmark = pytest.mark.integration

PD_CONFIG = CONFIG_DIR / "fleet.pd.local.yaml"
REQUESTS = 16  # the first, cold, long prompts: the split pays for several of them (router.pd)
TIME_SCALE = 0.05
MAX_OUTPUT_TOKENS = 16  # short answers: the run's wall time is the mocks' start-up, not decoding


@pytest.mark.timeout(60)
def test_the_demo_on_the_pd_fleet_splits_and_reports_the_split_share_and_pairs(
        capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(PD_CONFIG, default_catalog(), env={})
    reqs = mooncake_like(REQUESTS, rate_rps=2.5, seed=0, max_input_tokens=48_000, max_output_tokens=MAX_OUTPUT_TOKENS)
    report = run_policy(on_free_ports(settings, routing_seed=0), reqs, speedup=1.0, time_scale=TIME_SCALE,
                        progress=False)
    assert report["errors"] == 0, report["error_examples"]
    pd = report["pd"]
    assert pd["split_share"] > 0 and pd["splits"] == sum(p["splits"] for p in pd["pairs"])
    assert pd["splits_counted_by_gateway"] == pd["splits"]  # the gateway's own count agrees with the headers
    roles = {b["id"]: b["kv_role"] for b in report["backends"]}
    assert roles == {b.id: b.kv_role for b in settings.backends}
    for pair in pd["pairs"]:
        assert roles[pair["prefill_backend"]] in ("prefill", "both") and roles[pair["decode_backend"]] in ("decode", "both")
    assert sum(b["prefills"] for b in report["backends"]) == pd["splits"]
    json.dumps(report, allow_nan=False)
    report.update(workload="test")
    print_report(report, Console(width=300))
    text = " ".join(capsys.readouterr().out.split())
    assert f"{pd['splits']} requests split, split share {pd['split_share']:.1%}" in text
    first = pd["pairs"][0]
    assert f"{first['prefill_backend']} → {first['decode_backend']} {first['splits']}" in text
