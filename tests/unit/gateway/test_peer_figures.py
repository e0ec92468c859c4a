"""The figures replicas exchange (`gateway.replicas.figures`): their format and their sums."""

from __future__ import annotations

import pytest

from dispatch import Target, Ticket
from fleet_config.catalog import default_catalog
from gateway.replicas.figures import pack_figures, sum_figures
from router.cost import BackendSpec

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


def test_a_backends_figures_are_in_flight_kv_bytes_prefill_seconds_and_the_decode_batch() -> None:
    target = Target("b0", SPEC)
    Ticket(target.ledger, kv_bytes=3e6, prefill_s=0.25, context_tokens=1_100.0, output_tokens=200.0)
    Ticket(target.ledger, kv_bytes=1e6, prefill_s=0.5, context_tokens=500.0, output_tokens=100.0)
    assert pack_figures(target) == "2 4000000 0.750000 1600 300"


def test_sums_add_the_others_per_backend_skip_unknown_backends_and_report_the_gone() -> None:
    tables = [
        [b"b0", b"2 4000000 0.750000 1600 300", b"b9", b"7 1 1.0 1 1"],  # b9: not in this replica's config
        [],  # this member's hash expired
        ["b0", "1 1000000 0.250000", "b1", "3 0 0.000000"],  # a replica of the three-figure version, decoded
    ]
    sums, gone = sum_figures(["b0", "b1", "b2"], ["r1", "r2", "r3"], tables)
    assert sums == {"b0": [3, 5e6, 1.0, 1600.0, 300.0], "b1": [3, 0.0, 0.0, 0.0, 0.0], "b2": [0, 0.0, 0.0, 0.0, 0.0]}
    assert gone == ["r2"]


def test_replies_that_do_not_match_the_members_read_are_an_error() -> None:
    with pytest.raises(ValueError):
        sum_figures(["b0"], ["r1", "r2"], [[b"b0", b"1 0 0"]])
    with pytest.raises(ValueError, match="at least 3"):
        sum_figures(["b0"], ["r1"], [[b"b0", b"1 0"]])
