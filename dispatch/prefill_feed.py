"""How a backend's fit (`router.kappa_fit`) is fed: which prefill times, which requests.

Used by the gateway live (`gateway.backends.backend_set` closes intervals at its scrapes,
`gateway.proxy` reports what each attempt saw) and by the simulator in virtual time
(`sim.measure`), so both measure by the same rules.

**The measurement is the backend's own.** vLLM observes ``vllm:request_prefill_time_seconds``
(time from the step that first schedules a request to its first token, engine seconds) when
each request finishes; the gateway scrapes it every ``scrape_interval_s``, and the growth of its
sum between two scrapes is the summed prefill time of the requests that finished in between.
Timing prefills at the gateway instead would add the network, the backend's tokenisation
(which grows with the prompt) and, on a busy host, the event loop's delays.

**What the sum contains** under ordinary traffic — prefills that wait together, share the steps of
a chunked prefill, run beside decodes — is laid out by `dispatch.prefill_schedule`, which replays
vLLM's chunked-prefill schedule on the gateway's requests there: each request's prefill is the sum
of the steps its chunks ran in, whoever shared them.

**An interval counts** (becomes a `router.kappa_fit.PrefillInterval`) when:

- the backend's finished count grew by exactly the number of this gateway's requests that
  completed there since the interval began (its count minus ours is unchanged): no other
  client's request, no restart. A request whose end is on its way at a scrape (counted by the engine,
  not yet by the gateway, or the other way round) keeps the interval open until the counts
  agree again, at most `MAX_MERGED_SCRAPES` scrapes, and the merged interval is one sample;
- no request of this gateway's there ended otherwise in between (client gone, upstream failure,
  a split's decode phase, whose "prefill" is a KV pull);
- the steps of its requests are laid out and none is spoiled (`dispatch.prefill_schedule`: each
  request that ran in them completed with ``usage`` — a stream with ``stream_options.include_usage``
  — whose ``cached_tokens`` agrees with the index's estimate within `CACHED_TOKENS_TOLERANCE` tokens
  or `CACHED_TOKENS_TOLERANCE_RATIO` of the prompt, else which tier its cached tokens came from is
  unknown; the reported counts are used, the estimate only splits them by tier).

A backend that does not export the histogram gets no measured figures. When a request ends that
spoils its interval, or that loaded KV (load-bound ones are the scarce kind), the backend is scraped
at once, or as soon as `gateway.backends.backend_set.EXTRA_SCRAPE_MIN_GAP_S` has passed since its last
scrape began (`gateway.backends.backend_set.BackendSet.scrape_soon`): fewer requests share an
interval with either. (The simulator scrapes on its grid only: `sim.measure`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dispatch.prefill_schedule import PrefillSchedule
from router.cost import BackendSpec
from router.kappa_fit import PrefillInterval
from router.types import Candidate

CACHED_TOKENS_TOLERANCE = 128  # tokens: two index blocks of rounding (64-token blocks vs vLLM's 16)
CACHED_TOKENS_TOLERANCE_RATIO = 0.02  # of the prompt: the bytes-per-token estimate's own error
# New tokens one engine step prefills: vLLM's default max_num_batched_tokens for its OpenAI
# server (``EngineArgs.get_batch_defaults``): 8192 on GPUs of ≥ 70 GiB other than the A100 (the
# mock's default too), else 2048. An estimate: a backend may set its own.
SINGLE_STEP_TOKENS_ESTIMATE = {"large": 8192, "other": 2048}
LARGE_GPU_HBM_GIB = 70
# Scrapes an interval stays open for while the backend's count and ours disagree: one for a
# request's end on its way to the gateway at a scrape, a few for those of a burst.
MAX_MERGED_SCRAPES = 3


@dataclass(frozen=True, slots=True)
class DispatchTiming:
    """What `gateway.proxy.attempts.first_byte` saw of one attempt.

    Attributes:
        sent_s: ``gw.clock()`` when it was sent.
        sequence: its number in the backend's feed (`PrefillFeed.sent`; −1: not fed, a split's decode phase).
        headers_s: ``gw.clock()`` when its response headers arrived.
        stream: a streamed request.
    """

    sent_s: float
    sequence: int
    headers_s: float
    stream: bool


def single_step_tokens(spec: BackendSpec) -> int:
    """`SINGLE_STEP_TOKENS_ESTIMATE` for the backend's GPU."""
    hw = spec.hardware
    large = hw.hbm_gib >= LARGE_GPU_HBM_GIB and "a100" not in hw.name.lower()
    return SINGLE_STEP_TOKENS_ESTIMATE["large" if large else "other"]


def tiers(candidate: Candidate, usage: dict[str, Any] | None) -> tuple[tuple[int, int] | None,
                                                                      tuple[float, float, float] | None]:
    """A completed request's (prompt, cached) tokens from its ``usage``, and its cached tokens by tier
    (HBM, host tier, pool): the index's split scaled to the reported count; None where unknown (no usage,
    or cached tokens the index did not foresee: module docstring)."""
    if not usage:
        return None, None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(prompt, int) or not isinstance(cached, int) or not 0 <= cached < prompt:
        return None, None
    estimated = candidate.cached_tokens
    if abs(estimated - cached) > max(CACHED_TOKENS_TOLERANCE, CACHED_TOKENS_TOLERANCE_RATIO * prompt):
        return (prompt, cached), None
    scale = cached / estimated if estimated else 0.0
    host = candidate.cached_host_tokens * scale
    kv_pool = candidate.cached_kv_pool_tokens * scale
    return (prompt, cached), (cached - host - kv_pool, host, kv_pool)


@dataclass
class PrefillFeed:
    """One backend's requests between two scrapes, for its fit (module docstring).

    Args:
        spec: the backend's profile (`dispatch.prefill_schedule` prices its steps on it).

    ``pending`` holds, in order, the sequence number of each request that completed there since the
    interval began, and None for each that ended otherwise (or was not fed: a split's decode phase).
    """

    spec: BackendSpec
    pending: list[int | None] = field(default_factory=list)
    completed: int = 0  # this gateway's requests completed there, cumulative
    schedule: PrefillSchedule = field(init=False)
    _last: tuple[float, float, float] | None = None  # (count, sum s, count − completed) where the interval began
    _carried: list[int | None] = field(default_factory=list)  # an open interval's requests (`scraped`)
    _merged: int = 0  # scrapes the open interval has spanned
    _sent: int = 0  # attempts sent there, cumulative (a sequence number)
    _candidates: dict[int, Candidate] = field(default_factory=dict)  # sent, not ended

    def __post_init__(self) -> None:
        self.schedule = PrefillSchedule(self.spec, single_step_tokens(self.spec))

    def sent(self, sent_s: float, candidate: Candidate) -> int:
        """An attempt is sent there now (the router's figures for it there): its sequence number."""
        self._sent += 1
        self._candidates[self._sent] = candidate
        self.schedule.sent(self._sent, sent_s)
        return self._sent

    def first_token(self, sequence: int, now_s: float) -> None:
        """Its first token came back (a stream's first byte; a non-streamed answer has none)."""
        self.schedule.first_token(sequence, now_s)

    def failed(self, sequence: int, now_s: float) -> None:
        """It ended before its first byte (the engine aborts it, or never saw it)."""
        self.ended_otherwise(sequence, now_s)

    def ended_otherwise(self, sequence: int, now_s: float) -> None:
        """A request there ended without completing (client gone, upstream failure): the engine
        may have shared steps with it, so the interval it ends in cannot be attributed."""
        self._candidates.pop(sequence, None)
        self.schedule.completed(sequence, None, None, now_s)
        self.pending.append(None)

    def completed_request(self, sequence: int, usage: dict[str, Any] | None, now_s: float) -> bool:
        """A request completed there with ``usage`` (``sequence`` −1: one not fed, which spoils its
        interval). Returns whether an early scrape would help: after a request that spoils its interval
        or one that loaded KV (module docstring)."""
        candidate = self._candidates.pop(sequence, None)
        self.completed += 1
        if candidate is None:
            self.pending.append(None)
            return True
        tokens, by_tier = tiers(candidate, usage)
        self.schedule.completed(sequence, tokens, by_tier, now_s)
        self.pending.append(sequence if tokens is not None else None)
        return tokens is None or by_tier is None or by_tier[1] + by_tier[2] > 0

    def scraped(self, count: float | None, sum_s: float, *, end_s: float = 0.0,
                rates: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0),
                loaded_tokens: float | None = None) -> list[PrefillInterval]:
        """Close the interval at a scrape of the histogram's ``_count`` and ``_sum``; the samples ready.

        Args:
            count, sum_s: the scraped ``vllm:request_prefill_time_seconds`` ``_count`` and ``_sum``
                (count None: the backend does not export it), applied when the scrape's answer
                is read: the interval holds the requests that completed here until then.
            end_s: now, on the caller's clock (the interval's age in the fit, `router.kappa_fit`).
            rates: the fit's current factors (`dispatch.prefill_schedule.PrefillSchedule.ready`).
            loaded_tokens: the engine's count of prompt tokens it loaded, cumulative (vLLM's
                ``prompt_tokens_by_source{source="external_kv_transfer"}``; None: not exported), which
                checks the index's tier estimates (`dispatch.tier_check`).

        Returns the intervals whose steps are now laid out (this one's or earlier ones'), oldest first.
        When the backend's count minus ours moved (a request's end was on its way to the gateway
        at the scrape, or reached it first), the interval stays open: its requests and the sum
        it started from carry over to the next scrape, for up to `MAX_MERGED_SCRAPES` scrapes,
        until the counts agree again (a merged interval is a sum like any other). One that
        still disagrees then (another client's requests there) is dropped and the count starts
        afresh.
        """
        pending = self._carried + self.pending
        self.pending, self._carried = [], []
        self.schedule.loaded(end_s, loaded_tokens)
        if count is None:
            self._last, self._merged = None, 0
            return []
        last, diff = self._last, count - self.completed
        if last is None or count < last[0]:  # the first scrape, or a restart
            self._last, self._merged = (count, sum_s, diff), 0
        elif diff != last[2] and self._merged < MAX_MERGED_SCRAPES:
            self._carried, self._merged = pending, self._merged + 1
        else:
            self._last, self._merged = (count, sum_s, diff), 0
            if diff == last[2] and pending and None not in pending:
                self.schedule.interval(sum_s - last[1], tuple(s for s in pending if s is not None), end_s)
        return self.schedule.ready(rates, end_s, frozenset(s for s in self._carried if s is not None))
