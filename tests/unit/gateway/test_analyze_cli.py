"""``kappa-gateway analyze`` (issue 27, item 7) through the real typer app: workloads, a trace, the access log."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fleet_config.catalog import CONFIG_DIR, default_catalog
from gateway.commands.cli import app
from gateway.edge.access_log import ACCESS_LOGGER, AccessLog
from prefix_index import Finding

FLEET = str(CONFIG_DIR / "fleet.local.yaml")
RUNNER = CliRunner()


def analyze(*args: str) -> dict[str, Any]:
    result = RUNNER.invoke(app, ["analyze", "--config", FLEET, "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_whole_and_windowed_chat() -> None:
    whole = analyze("--workload", "chat", "-n", "600", "--link-gb-s", "64", "--host-tier-gb", "4000")
    window = analyze("--workload", "chat-sliding-window", "-n", "600")
    assert whole["invalidation"]["available"] and whole["invalidation"]["invalidated_tokens"] == 0
    assert whole["workload"]["hit_ratio_append_only"] == whole["workload"]["hit_ratio_allowed"] > 0.7
    by_cause = window["invalidation"]["by_cause"]
    assert by_cause["front_truncation"]["tokens"] == window["invalidation"]["invalidated_tokens"] > 0
    assert window["workload"]["hit_ratio_allowed"] < 0.6 < window["workload"]["hit_ratio_append_only"]
    assert [b["name"] for b in whole["backends"]] == ["b200-a", "b200-b", "gh200", "h100-capped"]
    b200 = whole["backends"][0]
    assert set(b200["what_if"]) == {"fp8_kv", "link_gb_s", "host_tier_gb"}
    assert b200["baseline"]["host_tier_gb"] == 256 and b200["what_if"]["host_tier_gb"]["host_tier_gb"] == 4000
    # A 256 GB host tier holds ~780k tokens of Llama-70B: the larger tier (and FP8) hold more of the chats.
    assert b200["what_if"]["host_tier_gb"]["hit_ratio"] > b200["baseline"]["hit_ratio"]
    assert b200["what_if"]["fp8_kv"]["hit_ratio"] > b200["baseline"]["hit_ratio"]
    assert b200["what_if"]["link_gb_s"]["transfer_bound_share"] < b200["baseline"]["transfer_bound_share"]
    assert set(window["backends"][0]["what_if"]) == {"fp8_kv"}


def test_catalog_hardware_rows_price_the_allowed_hit() -> None:
    report = analyze("--workload", "agentic-coding", "-n", "200", "--hardware", "all", "--model", "llama-3.1-8b")
    assert [b["name"] for b in report["backends"]] == list(default_catalog().hardware)
    for row in report["backends"]:  # no host tier given: the workload's allowed K, unbounded
        assert row["baseline"]["host_tier_gb"] is None
        assert row["baseline"]["hit_ratio"] == pytest.approx(report["workload"]["hit_ratio_allowed"], abs=1e-3)
    assert not report["invalidation"]["available"] and report["notes"]  # hash ids only: said, not invented


def test_a_trace_file(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 1_200, "output_length": 8,
                                         "hash_ids": [1, 2, 3 + i]}) + "\n" for i in range(5)))
    report = analyze(str(trace))
    assert report["source"] == {"trace": str(trace)}
    assert report["workload"]["requests"] == 5
    assert report["workload"]["hit_ratio_allowed"] == pytest.approx(4 * 1_024 / (5 * 1_200))


@pytest.mark.parametrize("json_lines", [True, False], ids=["json", "text"])
def test_the_gateways_access_log(tmp_path: Path, json_lines: bool) -> None:
    path = tmp_path / "access.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log = AccessLog(True, json_lines)
        base = {"route": "chat", "model": "llama-3.1-70b", "status": 200, "outcome": "ok", "kappa_ratio": 1.0}
        log.write(request_id="a", backend="b200-a", cached_tokens=0, uncached_prompt_tokens=2_000, regime="compute",
                  invalidated_tokens=0, invalidation_cause=None, **base)
        log.write(request_id="b", backend="b200-a", cached_tokens=1_024, uncached_prompt_tokens=3_000,
                  regime="compute", invalidated_tokens=2_900, invalidation_cause="front_truncation", **base)
        log.write(request_id="c", backend="gh200", cached_tokens=90_000, uncached_prompt_tokens=1_000,
                  regime="transfer", invalidated_tokens=0, invalidation_cause=None, **base)
        log.write(request_id="d", route="chat", backend="none", status=503, outcome="refused")
    finally:
        logger.removeHandler(handler)
        handler.close()
    report = analyze("--access-log", str(path))
    assert report["workload"]["requests"] == 3 and report["workload"]["hit_ratio_allowed"] is None
    assert report["workload"]["hit_ratio_as_routed"] == pytest.approx(91_024 / 97_024)
    assert report["invalidation"]["by_cause"]["front_truncation"] == {"requests": 1, "tokens": 2_900}
    rows = {b["name"]: b for b in report["backends"]}
    assert rows["gh200"]["routed_transfer_bound_share"] == 1.0 and rows["b200-a"]["routed_requests"] == 2
    assert rows["b200-a"]["baseline"]["transfer_bound_share"] == pytest.approx(1 / 3)  # K/T = 90 over PCIe
    assert any("no prompt hashes" in n for n in report["notes"])


def test_exactly_one_input() -> None:
    for args in ([], ["--workload", "chat", "--access-log", FLEET]):
        result = RUNNER.invoke(app, ["analyze", "--config", FLEET, *args])
        assert result.exit_code == 2 and "exactly one" in result.output
    result = RUNNER.invoke(app, ["analyze", "--config", FLEET, "--workload", "nope"])
    assert result.exit_code == 2 and "unknown workload" in result.output


def test_the_printed_report_names_its_tables() -> None:
    result = RUNNER.invoke(app, ["analyze", "--config", FLEET, "--workload", "chat-sliding-window", "-n", "200"])
    assert result.exit_code == 0, result.output
    for title in ("hit ratio allowed", "Prefix invalidation", "front_truncation", "Transfer-bound share", "FP8 KV"):
        assert title in result.output


def test_finding_fields_reach_the_access_log() -> None:
    from gateway.edge.access_log import invalidation_fields

    finding = Finding("compaction", 400, 100, 3, 9, 1, 7)
    assert invalidation_fields(finding) == {"invalidated_tokens": 100, "invalidation_cause": "compaction"}
    assert invalidation_fields(None) == {}
