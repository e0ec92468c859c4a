"""Which of the gateway's requests feed a backend's κ_crit fit (`router.kappa_fit`), and with what.

A request is one `router.kappa_fit.PrefillSample` when all of these hold:

- **Streamed, complete, with usage.** Its first content chunk is its first token. A
  non-streamed answer arrives whole after the generation (its first byte is its last token),
  so it says nothing about the prefill and is not used.
- **No queue of its own.** Its prefill time runs from the later of its response headers
  (vLLM, like the mock, answers a stream's headers once the request is tokenised and queued:
  the client-side parsing and tokenisation, which grow with the prompt, stay out) and the
  first byte of the last request this gateway sent to that backend before it (FIFO: its
  prefill cannot start before theirs ended) — to its first content chunk. Rejected when that
  last request was not streamed (its first byte came after its whole generation), when a
  request sent there *after* it got there before its first byte (it may have shared its
  engine steps), or when the backend's scraped ``num_requests_waiting`` exceeded the requests
  this gateway had queued there (someone else's queue).
- **The index was right.** The backend's reported ``cached_tokens`` agrees with the index's
  estimate within `CACHED_TOKENS_TOLERANCE_RATIO` of the prompt (or `CACHED_TOKENS_TOLERANCE`
  tokens): otherwise which tier the cached tokens came from is unknown. Token counts are the
  reported ones (T = prompt − cached); the estimate only splits the cached tokens into tiers.

With this, on the demo's traffic every backend's compute-bound samples number in the
hundreds and its load-bound ones in the few to dozens per 500 requests (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.kappa_fit import PrefillSample

if TYPE_CHECKING:
    from gateway.backends import BackendState
    from router.types import Candidate

CACHED_TOKENS_TOLERANCE = 128  # tokens: two index blocks of rounding (64-token blocks vs vLLM's 16)
CACHED_TOKENS_TOLERANCE_RATIO = 0.02  # of the prompt: the bytes-per-token estimate's own error
FIRST_BYTES_KEPT = 256  # per backend: recent first-byte times, for the requests queued behind them


@dataclass(frozen=True, slots=True)
class DispatchTiming:
    """What `gateway.attempts.first_byte` saw of one attempt's queue, for the κ_crit fit.

    Attributes:
        sequence: the backend ledger's ``dispatched_total`` once this attempt was charged.
        ahead: this gateway's requests waiting for their first byte there when it was sent.
        scraped_waiting: the backend's ``num_requests_waiting`` at the last scrape then.
        overtaken: a request sent there after it was charged before its first byte.
        headers_s, first_byte_s: ``gw.clock()`` when its headers and first body bytes arrived.
        stream: a streamed request.
    """

    sequence: int
    ahead: int
    scraped_waiting: int
    overtaken: bool
    headers_s: float
    first_byte_s: float
    stream: bool


def record_first_byte(state: BackendState, timing: DispatchTiming) -> None:
    """Remember when this attempt's first byte came (the requests queued behind it start then)."""
    first_bytes = state.first_bytes
    first_bytes[timing.sequence] = (timing.first_byte_s, timing.stream)
    if len(first_bytes) > FIRST_BYTES_KEPT:
        del first_bytes[next(iter(first_bytes))]  # insertion order: the oldest


def prefill_start_s(state: BackendState, timing: DispatchTiming) -> float | None:
    """When this request's prefill could start (module docstring), or None if unknown."""
    if timing.overtaken or timing.scraped_waiting > timing.ahead:
        return None
    if not timing.ahead:
        return timing.headers_s
    before = [v for seq, v in state.first_bytes.items() if seq < timing.sequence]
    if not before:
        return None
    last_s, last_streamed = max(before)
    if not last_streamed:
        return None
    return max(timing.headers_s, last_s)


def prefill_sample(state: BackendState, candidate: Candidate, timing: DispatchTiming, first_content_s: float,
                   usage: dict[str, Any]) -> PrefillSample | None:
    """The request's `PrefillSample`, or None when it does not count (module docstring)."""
    start_s = prefill_start_s(state, timing)
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if start_s is None or not isinstance(prompt, int) or not isinstance(cached, int) or not 0 <= cached < prompt:
        return None
    estimated = candidate.cached_tokens
    if abs(estimated - cached) > max(CACHED_TOKENS_TOLERANCE, CACHED_TOKENS_TOLERANCE_RATIO * prompt):
        return None
    scale = cached / estimated if estimated else 0.0
    host = candidate.cached_host_tokens * scale
    kv_pool = candidate.cached_kv_pool_tokens * scale
    if kv_pool and not state.spec.kv_pool_link_bytes_per_s:
        return None
    return PrefillSample.of(state.spec, cached_hbm_tokens=cached - host - kv_pool, cached_host_tokens=host,
                            cached_kv_pool_tokens=kv_pool, uncached_prompt_tokens=prompt - cached,
                            first_token_s=first_content_s - start_s)


def feed_kappa_fit(state: BackendState, candidate: Candidate, timing: DispatchTiming,
                   first_content_s: float | None, usage: dict[str, Any] | None) -> bool:
    """Offer a complete request to its backend's fit; returns whether it was taken. (The
    gauges follow at the backend's next scrape: `gateway.backends.BackendSet`.)"""
    if first_content_s is None or not usage:
        return False
    sample = prefill_sample(state, candidate, timing, first_content_s, usage)
    return sample is not None and state.kappa_fit.observe(sample)


def measured_fields(state: BackendState) -> dict[str, Any]:
    """The measured κ_crit as ``/v1/kappa/backends`` shows it: ``kappa_crit_linear_measured``
    (null until measured), its ``_ci`` ([low, high]) and ``kappa_fit`` (the interval's level,
    samples by class and link, u, v, a: `router.kappa_fit.KappaCritMeasurement`)."""
    fit = state.kappa_fit
    m = fit.measurement()
    held_compute, held_load = fit.samples
    if m is None:
        return {"kappa_crit_linear_measured": None, "kappa_crit_linear_measured_ci": None,
                "kappa_fit": {"samples_held": {"compute": held_compute, "load": held_load}}}
    return {
        "kappa_crit_linear_measured": m.kappa_crit_linear,
        "kappa_crit_linear_measured_ci": [m.ci_low, m.ci_high if math.isfinite(m.ci_high) else None],
        "kappa_fit": {
            "ci_level": m.ci_level,
            "samples": {"compute": m.compute_samples, "load": m.load_samples, "kv_pool_load": m.kv_pool_load_samples},
            "samples_held": {"compute": held_compute, "load": held_load},
            "compute_time_ratio": m.compute_time_ratio, "load_time_ratio": m.load_time_ratio,
            "overhead_s": m.overhead_s,
        },
    }
