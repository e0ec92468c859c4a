"""What the routing pipeline (`dispatch.pipeline`) takes and gives: the request, the plan, the hooks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dispatch.target import Target
from prefix_index import PrefixIndexError
from router.types import BackendView, Decision, RequestFeatures

__all__ = ["DispatchHooks", "Plan", "RoutableRequest"]


@dataclass(frozen=True, slots=True)
class RoutableRequest:
    """What routing needs of a request: its model, prompt chain and sizes.

    Attributes:
        model: the served model name.
        hashes: the prompt's chained block hashes (`prefix_index.block_hashes`).
        prompt_bytes: length of its canonical prompt bytes (tokens ≈ bytes / bytes-per-token).
        max_tokens: tokens it may generate per sequence (its KV grows by as much).
        sequences: output sequences (OpenAI's ``n``, ≥ 1): each holds its own output KV.
        prompt_tokens: its prompt's token count when known (token ids), else None (estimated from bytes).
        engine_hashes: its engine chain (`prefix_index.engine_chain.own_chain` of its token ids at
            ``engine_block_tokens``) when the exact index routes it, else empty (`dispatch.exact`).
    """

    model: str
    hashes: Sequence[int]
    prompt_bytes: int
    max_tokens: int
    sequences: int = field(default=1, kw_only=True)
    prompt_tokens: int | None = field(default=None, kw_only=True)  # exact, when its token ids are known
    engine_hashes: Sequence[int] = field(default=(), kw_only=True)
    engine_block_tokens: int = field(default=0, kw_only=True)


@dataclass(frozen=True, slots=True)
class Plan:
    """A decision plus what the bookkeeping needs.

    Attributes:
        request: what was routed.
        features: the router's view of the request.
        views: one per target, in the targets' order.
        decision: the ranking (``decision.chosen`` first, then where retries go).
        targets: the targets by id.
        index_ok: the index answered (False: routed without prefix matches).
        index_epoch: `Dispatcher.forget_epoch` when it was routed (answers to requests routed
            before a holder's entries were dropped are no evidence about the new ones).
    """

    request: RoutableRequest
    features: RequestFeatures
    views: tuple[BackendView, ...]
    decision: Decision
    targets: dict[str, Target]
    index_ok: bool
    index_epoch: int = 0


class DispatchHooks(Protocol):
    """Where the pipeline reports index health and timings (the gateway's telemetry)."""

    def index_failed(self, op: str, exc: PrefixIndexError) -> None:
        """An index call (``match``, ``record``, ``forget``) failed; routing goes on without it."""

    def index_answered(self, op: str, seconds: float) -> None:
        """An index call succeeded after ``seconds``."""

    def decided(self, seconds: float) -> None:
        """A (non-dry-run) decision took ``seconds``, the index lookup excluded."""
