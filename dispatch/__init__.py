"""The one routing pipeline, shared by the live gateway and the simulator (DESIGN.md §2).

    target     Target (a backend: spec, last scrape, ledger), BackendMetrics (one scrape)
    ledger     Ledger (per backend), Ticket (per request: charge, first byte, finish)
    pipeline   Dispatcher: capacities → index match → in-flight and pool overlays →
               features and views → `router.decide` → charge / record / forget / calibrate
    evidence   CachedTokensEvidence: answers' cached_tokens against the index's credit
               (outcome within one block; holders to forget when short again and again)

May import `router` and `prefix_index` only; no I/O of its own (the index does it), no clock
but an injected one. Importing it selects no build: the entry points do (`hot_path.select`).
"""

from dispatch.evidence import CachedTokensCheck, CachedTokensEvidence
from dispatch.ledger import Ledger, Ticket
from dispatch.pipeline import DispatchHooks, Dispatcher, Plan, RoutableRequest
from dispatch.target import BackendMetrics, Target

__all__ = ["BackendMetrics", "CachedTokensCheck", "CachedTokensEvidence", "DispatchHooks", "Dispatcher", "Ledger", "Plan", "RoutableRequest", "Target", "Ticket"]
