"""Prometheus metrics of the gateway, on an injected registry."""
