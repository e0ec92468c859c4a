"""Prometheus metrics of the gateway, on an injected registry.

    metrics        `Telemetry`: every series, the ``/metrics`` page (one process or ``serve --workers``)
    metric_values  a worker's write-behind metric values (prometheus-client's multiprocess mode)
"""
