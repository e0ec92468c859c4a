"""Prefix invalidation, live: the gateway's detector, its counters, and each chat body's pending finding.

The truncation trap of issue 27: a client that rewrites the front of its context (a sliding window,
a summary, an edited or reordered message) has every later token prefilled again, and the hit rate
falls with nothing reporting a fault. `prefix_index.invalidation` finds such requests from their
message fingerprints; here the gateway keeps one detector per process (bounded:
`prefix_index.InvalidationDetector`, ≤ 8.9 MB) and counts what it finds:

- ``gateway_prefix_invalidated_tokens_total{model, cause}``: the tokens re-prefilled, at the
  model's calibrated bytes/token (`router.calibration.BytesPerToken`);
- ``gateway_prefix_invalidations_total{model, cause}``: the requests.

The gateway has no tenants (client keys carry no name: `gateway.edge.auth`), so there is no tenant
label; ``cache_salt`` seeds the message hashes, so salted conversations are told apart all the same.
With ``serve --workers`` each worker holds its own detector (a conversation whose turns reach two
workers goes unseen there: an under-count, never a false alarm); replicas do not share theirs.

**Off the critical path.** A body's fingerprint and its finding cost ~10 µs for a 24-message chat
and ~50 µs for 64 messages (``python bench/invalidation_bench.py``), so the proxy asks for the
finding from a callback that runs once the request is on its way upstream
(`gateway.proxy.handler`); until then the body's canonical bytes wait in its `PendingFinding`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.telemetry.metrics import Telemetry
from prefix_index import (
    INVALIDATION_CAUSES,
    Finding,
    InvalidationDetector,
    MessageFingerprint,
    message_fingerprint,
)


@dataclass(slots=True)
class PendingFinding:
    """A chat body's prefix-invalidation finding, computed at most once (`LiveInvalidation.finding`).

    Attributes:
        canonical: the body's canonical bytes until fingerprinted, then None (as large as the body:
            not held while a stream runs).
        seed: its chain seed (model and ``cache_salt``), which seeds the message hashes.
        messages: its fingerprint once computed (12 bytes a message).
        finding: the finding once the request was counted, None before.
    """

    canonical: bytes | None
    seed: int
    messages: MessageFingerprint | None = None
    finding: Finding | None = None

    def fingerprint(self) -> MessageFingerprint:
        """The body's fingerprint, computed on first use; the canonical bytes are then let go."""
        if self.messages is None:
            assert self.canonical is not None, "canonical bytes are kept until the fingerprint exists"
            self.messages = message_fingerprint(self.canonical, self.seed)
            self.canonical = None
        return self.messages


class LiveInvalidation:
    """The process's detector and its counters, every (model, cause) series created at 0.

    Args:
        telemetry: where the counters live.
        models: the served model names (label values come only from the config).
        detector: the detector (default limits: `prefix_index.invalidation`).
    """

    def __init__(self, telemetry: Telemetry, models: Iterable[str], detector: InvalidationDetector | None = None) -> None:
        self.detector = detector or InvalidationDetector()
        self._series = {(m, c): (telemetry.invalidated_tokens.labels(m, c), telemetry.invalidations.labels(m, c))
                        for m in models for c in INVALIDATION_CAUSES}

    def finding(self, pending: PendingFinding, model: str, bytes_per_token: float, *, dry_run: bool = False) -> Finding:
        """The body's finding (`prefix_index.Finding`), tokens at ``bytes_per_token`` (> 0).

        Unless ``dry_run`` the request is remembered as its conversation's latest and a finding with
        a cause is counted, once: a second call returns the same finding. A dry run
        (``/v1/kappa/route``) changes nothing.
        """
        if pending.finding is not None:
            return pending.finding
        if dry_run:
            return self.detector.inspect(pending.fingerprint(), bytes_per_token=bytes_per_token)
        finding = pending.finding = self.detector.observe(pending.fingerprint(), bytes_per_token=bytes_per_token)
        if finding.cause is not None:
            tokens, requests = self._series[(model, finding.cause)]
            tokens.inc(finding.invalidated_tokens)
            requests.inc()
        return finding
