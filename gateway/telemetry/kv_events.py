"""The KV-event subscribers' metrics (issue 30), on the gateway's injected registry.

| metric | type | labels |
| --- | --- | --- |
| ``gateway_kv_events_mode`` | gauge, one-hot | backend, mode = exact\\|degraded\\|approximate (1 on the backend's mode) |
| ``gateway_kv_events_batches_total`` | counter | backend, outcome = applied\\|duplicate\\|gap\\|replayed\\|malformed |
| ``gateway_kv_events_exact_blocks`` | gauge | backend, tier = hbm\\|host (distinct blocks the exact index holds) |

``duplicate`` counts batches another replica (or an earlier copy) applied first; ``gap`` batches
that found missed ones before them (each starts a replay); ``replayed`` batches applied from a
replay; ``malformed`` messages that did not decode (`gateway.backends.kv_events`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefix_index.engine_events import Tier

__all__ = ["KvEventsTelemetry"]


class KvEventsTelemetry:
    """The three metric families above; every series a backend can touch is created at 0."""

    MODES = ("exact", "degraded", "approximate")
    OUTCOMES = ("applied", "duplicate", "gap", "replayed", "malformed")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.mode = Gauge("gateway_kv_events_mode", "1 on the backend's KV-event mode (exact: routed on the engine's "
                          "own events; degraded: a gap, lag, replay or partial state; approximate: no event stream).",
                          ["backend", "mode"], multiprocess_mode="mostrecent", registry=registry)
        self.batches = Counter("gateway_kv_events_batches", "KV-event batches received, by outcome.",
                               ["backend", "outcome"], registry=registry)
        self.exact_blocks = Gauge("gateway_kv_events_exact_blocks", "Distinct blocks the exact (event-fed) index "
                                  "holds for the backend, by tier.", ["backend", "tier"],
                                  multiprocess_mode="mostrecent", registry=registry)

    def init_backend(self, backend_id: str) -> None:
        """Create the backend's series at 0 (approximate until its subscriber connects)."""
        for outcome in self.OUTCOMES:
            self.batches.labels(backend_id, outcome)
        self.set_blocks(backend_id, {})
        self.set_mode(backend_id, "approximate")

    def set_mode(self, backend_id: str, mode: str) -> None:
        for name in self.MODES:
            self.mode.labels(backend_id, name).set(1.0 if name == mode else 0.0)

    def count(self, backend_id: str, outcome: str) -> None:
        self.batches.labels(backend_id, outcome).inc()

    def set_blocks(self, backend_id: str, blocks: Mapping[Tier, int]) -> None:
        for tier in Tier:
            self.exact_blocks.labels(backend_id, tier.value).set(blocks.get(tier, 0))
