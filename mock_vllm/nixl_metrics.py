"""The KV-transfer metrics vLLM's NixlConnector exports, under its names, buckets and labels.

Source: ``NixlPromMetrics`` / ``NixlKVConnectorStats`` (vLLM ``vllm/distributed/kv_transfer/
kv_connector/v1/nixl_connector.py`` at commit 002a1057, NIXL connector version 2, and the later
``.../v1/nixl/stats.py``, which added ``vllm:nixl_num_kv_expired_reqs``). Labels are vLLM's
per-engine ones, ``model_name`` and ``engine``; **no label names the remote engine**, so what a
scraper can derive is per *decode* backend, over all the prefill peers it read from.

=====================================  =========  ==================================================
``vllm:nixl_xfer_time_seconds``        histogram  one transfer's duration (NIXL ``xferDuration``)
``vllm:nixl_post_time_seconds``        histogram  its post time (``postDuration``)
``vllm:nixl_bytes_transferred``        histogram  its bytes (``totalBytes``)
``vllm:nixl_num_descriptors``          histogram  its descriptors (``descCount``)
``vllm:nixl_num_failed_transfers``     counter    reads that failed (decode side)
``vllm:nixl_num_failed_notifications`` counter    notifications that failed (decode side)
``vllm:nixl_num_kv_expired_reqs``      counter    held KV released by the timeout (prefill side)
=====================================  =========  ==================================================

vLLM records one transfer **per TP rank** of the reader: each rank reads its own shard of the
heads (``bytes / tp``) over its own NIC in the same time, and the ranks' observations are pooled.
The mock does the same, so ``rate(bytes_sum) / rate(time_sum)`` is a rank's bandwidth, and the
link's delivered bandwidth is that × the decode backend's ``tensor_parallel``. Times are engine
seconds (the modelled link), like every other mock histogram.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from mock_vllm.metrics import ENGINE_INDEX, LABELS

# vLLM's buckets: time 0.001…5 s (post time; the transfer time drops the first), bytes 2 KiB…8 GiB
# (2^11, 2^13, … 2^33), descriptors 10…50,000.
TIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)


class NixlMetrics:
    """The NIXL connector's series for one mock on an injected registry.

    Args:
        registry: the mock's registry.
        model_name: the served model name (the ``model_name`` label).
    """

    def __init__(self, registry: CollectorRegistry, *, model_name: str) -> None:
        labels = (model_name, ENGINE_INDEX)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*labels)

        self.xfer_time = histogram("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.", TIME_BUCKETS_S[1:])
        self.post_time = histogram("vllm:nixl_post_time_seconds",
                                   "Histogram of transfer post time for NIXL KV Cache transfers.", TIME_BUCKETS_S)
        self.bytes_transferred = histogram("vllm:nixl_bytes_transferred",
                                           "Histogram of bytes transferred per NIXL KV Cache transfers.", BYTES_BUCKETS)
        self.num_descriptors = histogram("vllm:nixl_num_descriptors",
                                         "Histogram of number of descriptors per NIXL KV Cache transfers.",
                                         DESCRIPTOR_BUCKETS)
        self.failed_transfers = counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.")
        self.failed_notifications = counter("vllm:nixl_num_failed_notifications",
                                            "Number of failed NIXL KV Cache notifications.")
        self.kv_expired_reqs = counter("vllm:nixl_num_kv_expired_reqs",
                                       "Number of requests that had their KV expire. NOTE: This metric is tracked "
                                       "on the P instance.")

    def record_transfer(self, *, duration_s: float, post_s: float, num_bytes: float, descriptors_per_rank: int,
                        ranks: int) -> None:
        """One read of ``num_bytes`` bytes in ``duration_s`` engine seconds by ``ranks`` TP ranks, each
        observing its shard: ``num_bytes / ranks`` bytes (every rank reads every block's layers: one
        descriptor per region and block)."""
        for _ in range(ranks):
            self.xfer_time.observe(duration_s)
            self.post_time.observe(post_s)
            self.bytes_transferred.observe(num_bytes / ranks)
            self.num_descriptors.observe(descriptors_per_rank)
