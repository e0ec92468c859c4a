"""A request's charges on its backend's ledger: what its decode will weigh in the batch (issue 25)."""

from __future__ import annotations

import random

from dispatch import BackendMetrics, Dispatcher, RoutableRequest, Target
from fleet_config import default_catalog
from prefix_index import MemoryPrefixIndex
from router.calibration import BytesPerToken
from router.cost import BackendSpec
from router.policies import build_policy
from sim.simulator import run_now

CATALOG = default_catalog()
SPEC = BackendSpec(model=CATALOG.model("llama-3.1-8b"), hardware=CATALOG.hw("h100-sxm"))


def dispatcher() -> Dispatcher:
    return Dispatcher(MemoryPrefixIndex(), build_policy("kappa", {}), random.Random(0), BytesPerToken(4.0),
                      block_size_bytes=256)


def test_a_ticket_charges_the_decode_context_and_output_and_releases_them() -> None:
    """4,000 prompt bytes at 4 bytes/token = 1,000 tokens, max_tokens 200, n = 3: the ledger holds
    3 × (1,000 + 100) tokens of decode context and 600 output tokens until the request ends."""
    d, target = dispatcher(), Target("a", SPEC)
    plan = run_now(d.plan(RoutableRequest("m", [], 4_000, 200, sequences=3), [target]))
    ticket = d.charge(plan, plan.decision.chosen)
    assert (target.ledger.context_tokens, target.ledger.output_tokens) == (3_300.0, 600.0)
    ticket.first_byte()
    assert target.ledger.context_tokens == 3_300.0  # decoding: still in the batch
    second = d.charge(plan, plan.decision.chosen)
    view = run_now(d.plan(RoutableRequest("m", [], 4_000, 200), [target])).views[0]
    assert (view.context_tokens, view.output_tokens) == (6_600.0, 1_200.0)
    ticket.finish()
    second.finish()
    assert (target.ledger.context_tokens, target.ledger.output_tokens) == (0.0, 0.0)


def test_foreign_requests_are_set_against_the_ledger_at_the_scrape() -> None:
    """A scrape finds 7 running and 2 waiting where the gateway has 4 in flight: 5 came from elsewhere,
    and stay 5 until the next scrape, however the ledger moves in between."""
    d, target = dispatcher(), Target("a", SPEC)
    plan = run_now(d.plan(RoutableRequest("m", [], 4_000, 200), [target]))
    tickets = [d.charge(plan, plan.decision.chosen) for _ in range(4)]
    target.scraped(BackendMetrics(num_requests_running=7, num_requests_waiting=2))
    assert target.foreign_requests == 5
    for t in tickets:
        t.finish()
    assert target.foreign_requests == 5
    assert run_now(d.plan(RoutableRequest("m", [], 4_000, 200), [target])).views[0].foreign_requests == 5
    target.scraped(BackendMetrics(num_requests_running=1))
    assert target.foreign_requests == 1
    more = [d.charge(plan, plan.decision.chosen) for _ in range(3)]
    target.scraped(BackendMetrics(num_requests_running=2))  # fewer than the ledger (not yet arrived): 0
    assert target.foreign_requests == 0
    for t in more:
        t.finish()
