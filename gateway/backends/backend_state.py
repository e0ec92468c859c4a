"""One backend's state as the gateway keeps it: a `dispatch.Target` plus what only the edge needs.

The `dispatch.Target` part (its spec, last scrape and ledger) is what the routing pipeline
reads; the rest is the edge's: its config entry, health (in rotation or not, and the
active-check and outlier counters behind it, `gateway.backends.outlier`). Its measured figures
(the fit, the requests that feed it, the spec routing uses) are the `dispatch.Target`'s
(`dispatch.measured`). The backend set (`gateway.backends.backend_set`) and the tickets are the
only writers.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from dispatch import Target
from fleet_config.settings import BackendEntry
from dispatch.prefill_feed import PrefillFeed
from gateway.backends.outlier import OutlierRecord
from router.cost import BackendSpec
from router.kappa_fit import KappaCritFit
from router.link_factors import MeasurementSettings
from router.profiles import GB


@dataclass(eq=False)
class BackendState(Target):
    """Everything the gateway knows about one backend. Mutated only by the backend set and tickets.

    Build it with `BackendState.of` (from a config entry and its spec).
    """

    entry: BackendEntry = field(kw_only=True)
    healthy: bool = field(default=False, kw_only=True)  # in rotation: passes its checks and is not ejected
    model_checked: bool = field(default=False, kw_only=True)  # /v1/models listed the configured model
    serves_other_model: bool = field(default=False, kw_only=True)  # /v1/models did not: never routed to
    outlier: OutlierRecord = field(default_factory=OutlierRecord, kw_only=True, repr=False)
    scrape_lock: asyncio.Lock = field(default_factory=asyncio.Lock, kw_only=True, repr=False)  # one scrape at a time
    last_scrape_s: float = field(default=-math.inf, kw_only=True)  # loop time the last scrape began
    down_signal: asyncio.Future[str] | None = field(default=None, kw_only=True, repr=False)
    # Why its last health check failed (refused, DNS, timeout, an HTTP status, another model
    # served), None once one passed: what /v1/kappa/backends and the log say of a backend not up.
    check_error: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.healthy:  # built in rotation (tests, benches): as if it had passed its checks
            self.outlier.hc_healthy = self.outlier.ever_healthy = True

    @property
    def kappa_fit(self) -> KappaCritFit:
        """Its measured figures' fit (`router.kappa_fit`)."""
        return self.figures.fit

    @property
    def prefill_feed(self) -> PrefillFeed:
        """The requests and intervals that feed it (`dispatch.prefill_feed`)."""
        return self.figures.feed

    @classmethod
    def of(cls, entry: BackendEntry, spec: BackendSpec, *, healthy: bool = False,
           measurement: MeasurementSettings | None = None) -> BackendState:
        """The state of a configured backend (its host tier and KV block override from ``entry``;
        ``measurement``: the config's ``routing.measured_figures``, default its defaults)."""
        return cls(entry.id, spec, host_tier_bytes=entry.host_tier_gb * GB,
                   num_gpu_blocks_override=entry.num_gpu_blocks_override,
                   measurement=measurement or MeasurementSettings(), entry=entry, healthy=healthy)
