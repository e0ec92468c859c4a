"""Measured figures in the simulator: the engines' prefill-time histogram and the gateway's feed of its fit.

What the router sees is what it would see live (DESIGN.md §2): each engine's
``vllm:request_prefill_time_seconds`` ``_count`` and ``_sum`` (`PrefillClock`, observed as the
mock's server observes it: from the step that first scheduled a request to its first token,
when it finishes), scraped with the rest of its metrics; and, per request, what the gateway's
relay knows — when it was sent, which of its requests were before their first byte there, when
its first token came back, and the usage it reported (prompt and cached tokens, not their
tiers). From those, `dispatch.prefill_feed` and `dispatch.measured` do what they do live: close
an interval at each scrape, fit, and move the backend's routed spec.

Not modelled: the gateway's extra scrapes after a request that spoils its interval or a load-bound one
(`gateway.backends.backend_set.BackendSet.scrape_soon`); the simulator scrapes on its grid only,
so its intervals hold more requests than live ones and fewer are clean.
"""

from __future__ import annotations

from typing import Any

from dispatch import Target
from mock_vllm.types import RequestOutput
from router.link_factors import FACTORS
from router.types import Candidate

__all__ = ["PrefillClock", "Sent", "measured_figures"]


class PrefillClock:
    """One engine's ``vllm:request_prefill_time_seconds`` as its /metrics would export it."""

    __slots__ = ("count", "sum_s", "_first_token_s")

    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self._first_token_s: dict[str, float] = {}

    def output(self, out: RequestOutput, now: float) -> None:
        """An output of a step that ended at ``now``: a first token starts its request's clock's end,
        a finish observes its prefill time (first token − first scheduled)."""
        first = self._first_token_s.get(out.request_id)
        if first is None and out.new_token_ids:
            first = self._first_token_s[out.request_id] = now
        if out.finished:
            self._first_token_s.pop(out.request_id, None)
            if first is not None and out.scheduled_s is not None:
                self.count += 1
                self.sum_s += first - out.scheduled_s


class Sent:
    """One request the gateway sent to a target, as its relay reports it to the target's feed."""

    __slots__ = ("target", "sequence")

    def __init__(self, target: Target, candidate: Candidate, now: float) -> None:
        self.target = target
        self.sequence = target.figures.feed.sent(now, candidate)

    def first_token(self, now: float) -> None:
        """Its first token came back at ``now`` (a stream's first byte)."""
        self.target.figures.feed.first_token(self.sequence, now)

    def finished(self, out: RequestOutput, now: float) -> None:
        """It completed with the engine's usage (prompt and cached tokens, as vLLM reports them)."""
        usage = {"prompt_tokens": out.prompt_tokens, "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
        self.target.figures.feed.completed_request(self.sequence, usage, now)


def measured_figures(targets: list[Target]) -> dict[str, dict[str, Any]]:
    """Per target id at the end of a run: each factor measured (time ratio, requests; None: no
    evidence), the factors routing used last, and the measured κ_crit at the host and pool links."""
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        m = t.figures.measurement()
        factors = dict.fromkeys(FACTORS) if m is None else {
            name: None if e is None else {"time_ratio": e.time_ratio, "requests": e.requests}
            for name, e in zip(FACTORS, m.factors, strict=True)}
        out[t.id] = {
            "factors": factors, "routed": t.figures.factors._asdict(), "intervals": t.figures.observed,
            "kappa_crit_linear": t.profile_spec.kappa_crit_linear,
            "kappa_crit_linear_measured": None if m is None or m.kappa_crit_linear is None else m.kappa_crit_linear.value,
            "kappa_crit_linear_kv_pool_measured": None if m is None or m.kappa_crit_linear_kv_pool is None
            else m.kappa_crit_linear_kv_pool.value,
        }
    return out
