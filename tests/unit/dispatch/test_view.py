"""`dispatch.views.view_of` builds a `BackendView` positionally (a keyword call costs 4× as much,
once per backend per request): every field must come from its own source, whatever the order."""

from __future__ import annotations

from dispatch import BackendMetrics, Target
from dispatch.ledger import Ticket
from dispatch.views import view_of
from fleet_config import default_catalog
from prefix_index import BlockMatch
from prefix_index.base import TierCapacity
from router.cost import BackendSpec
from router.types import BackendView

CATALOG = default_catalog()
H100_8B = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


def test_every_field_of_the_view_comes_from_its_source() -> None:
    target = Target("b3", H100_8B, num_gpu_blocks_override=4_000)
    target.scraped(BackendMetrics(num_requests_waiting=7, num_requests_running=11, kv_cache_usage_ratio=0.25))
    ledger = target.ledger
    Ticket(ledger, 1.5e9, 0.125, context_tokens=9_000.0, output_tokens=300.0)
    ledger.recorded_blocks = 90
    ledger.peer_in_flight, ledger.peer_kv_demand_bytes, ledger.peer_outstanding_prefill_s = 2, 5e8, 0.5
    ledger.peer_context_tokens, ledger.peer_output_tokens = 1_000.0, 40.0

    view = view_of(target, BlockMatch(64, 40, 16, 8, 32), TierCapacity(80, 200))

    assert view._asdict() == {
        "backend_id": "b3", "spec": H100_8B,
        "matched_blocks": 64, "hbm_blocks": 40, "host_blocks": 16, "kv_pool_blocks": 8, "in_flight_blocks": 32,
        "cached_blocks": 90,  # the ledger's 90 recorded blocks, within the 280 the tiers hold
        "in_flight": 3, "kv_demand_bytes": 2e9, "outstanding_prefill_s": 0.625,
        "kv_capacity_bytes": target.kv_capacity_bytes,
        "num_requests_waiting": 7, "num_requests_running": 11, "kv_cache_usage_ratio": 0.25,
        "context_tokens": 10_000.0, "output_tokens": 340.0,
        "foreign_requests": 18,  # 7 + 11 seen by the scrape, none in flight then
    }
    assert set(view._asdict()) == set(BackendView._fields)  # no field left at its default unnoticed
