"""Prometheus metrics of P/D disaggregation (issue 26), on the gateway's injected registry.

| metric | type | labels |
| --- | --- | --- |
| ``gateway_pd_splits_total`` | counter | prefill_backend, decode_backend: requests split (prefill on one, decode on the other) |
| ``gateway_pd_prefill_fallbacks_total`` | counter | prefill_backend, reason: splits whose prefill phase failed and that went whole to the decode backend (``connect-failure``, ``reset``, ``5xx``, ``timeout``, ``4xx``, ``no-kv-transfer-params``) |
| ``gateway_pd_prefill_seconds`` | histogram | prefill_backend: the prefill phase, from sending to its whole answer |
| ``gateway_pd_link_state`` | gauge | prefill_backend, decode_backend: 0 healthy, 1 degraded, 2 broken (`router.links.LinkHealth`) |
| ``gateway_pd_link_delivered_bytes_per_second`` | gauge | prefill_backend, decode_backend: what the link delivered, measured from the decode engine's KV-connector metrics |
| ``gateway_pd_link_configured_bytes_per_second`` | gauge | prefill_backend, decode_backend: the config's sustained figure |

Label values are backend ids from the config and the closed set of reasons above.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
LINK_STATE_VALUES = {"healthy": 0, "degraded": 1, "broken": 2}


class PdTelemetry:
    """The P/D metrics (module docstring)."""

    def __init__(self, r: CollectorRegistry) -> None:
        pair = ["prefill_backend", "decode_backend"]
        self.splits = Counter("gateway_pd_splits", "Requests split: prefilled on one backend, decoded on another.",
                              pair, registry=r)
        self.prefill_fallbacks = Counter(
            "gateway_pd_prefill_fallbacks", "Split requests whose prefill phase failed; each went whole to its "
            "decode backend, which prefilled it locally.", ["prefill_backend", "reason"], registry=r)
        self.prefill_seconds = Histogram("gateway_pd_prefill_seconds", "The prefill phase of split requests, "
                                         "from sending it to its whole answer.", ["prefill_backend"],
                                         buckets=PREFILL_BUCKETS, registry=r)
        self.link_state = Gauge("gateway_pd_link_state", "P/D link health: 0 healthy, 1 degraded, 2 broken (no "
                                "splits over a link that is not healthy).", pair, multiprocess_mode="mostrecent",
                                registry=r)
        self.link_delivered = Gauge("gateway_pd_link_delivered_bytes_per_second", "KV bandwidth the link delivered, "
                                    "from the decode engine's KV-connector metrics.", pair,
                                    multiprocess_mode="mostrecent", registry=r)
        self.link_configured = Gauge("gateway_pd_link_configured_bytes_per_second", "The link's configured "
                                     "sustained bandwidth.", pair, multiprocess_mode="mostrecent", registry=r)
