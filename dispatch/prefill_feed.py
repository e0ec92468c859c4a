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

**An interval counts** (becomes a `router.kappa_fit.PrefillInterval`) when:

- the backend's finished count grew by exactly the number of this gateway's requests that
  completed there since the interval began (its count minus ours is unchanged): no other
  client's request, no restart. A request whose end is on its way at a scrape (counted by the engine,
  not yet by the gateway, or the other way round) keeps the interval open until the counts
  agree again, at most `MAX_MERGED_SCRAPES` scrapes, and the merged interval is one sample;
- no request of this gateway's there ended otherwise in between (client gone, upstream failure);
- each of those requests can be predicted: it completed with ``usage`` (a stream: with
  ``stream_options.include_usage``) whose ``cached_tokens``
  agrees with the index's estimate within `CACHED_TOKENS_TOLERANCE` tokens or
  `CACHED_TOKENS_TOLERANCE_RATIO` of the prompt (otherwise which tier its cached tokens came
  from is unknown; the reported counts are used, the estimate only splits the cached tokens by
  tier), and it prefilled alone. vLLM schedules the running requests' next chunks first, then
  admits waiting ones with the token budget left, so a prefill shares engine steps with
  another request's when both wait together, when it waits behind a multi-step (chunked)
  prefill, or when it is itself multi-step and a later request arrives. So: at most one
  request of this gateway's was before its first byte there when it was sent, and that one
  fits one step (T ≤ `single_step_tokens`) and was sent `QUEUE_SETTLE_S` earlier (it
  was running, not waiting: a request waits at most one decode step when nothing is queued);
  and, if its own T exceeds one step, nothing was sent there after it before its first byte.
  (Other clients' prefills are not seen; their requests finishing in an interval drop it.
  The scraped ``num_requests_waiting`` cannot tell theirs from this gateway's: it lags by up
  to a scrape interval.)

Streamed or not makes no difference: the engine times the prefill either way. A backend
that does not export the histogram gets no measured κ_crit. When a request that spoils its
interval ends, and when a load-bound one (the scarce kind) ends, the backend is scraped at
once, or as soon as `gateway.backends.backend_set.EXTRA_SCRAPE_MIN_GAP_S` has passed since its
last scrape began (`gateway.backends.backend_set.BackendSet.scrape_soon`; the simulator closes an interval for the fit alone then, `sim.measure`): fewer requests share
an interval with either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.cost import BackendSpec
from router.kappa_fit import PrefillInterval, PrefillPrediction
from router.types import Candidate

CACHED_TOKENS_TOLERANCE = 128  # tokens: two index blocks of rounding (64-token blocks vs vLLM's 16)
CACHED_TOKENS_TOLERANCE_RATIO = 0.02  # of the prompt: the bytes-per-token estimate's own error
# New tokens one engine step prefills: vLLM's default max_num_batched_tokens for its OpenAI
# server (``EngineArgs.get_batch_defaults``): 8192 on GPUs of ≥ 70 GiB other than the A100 (the
# mock's default too), else 2048. An estimate: a backend may set its own.
SINGLE_STEP_TOKENS_ESTIMATE = {"large": 8192, "other": 2048}
LARGE_GPU_HBM_GIB = 70
# A request with nothing queued is scheduled at the next step boundary: one decode step, ~10 ms
# on the catalog's GPUs (the weights read from HBM); five of those, in the gateway's wall seconds.
QUEUE_SETTLE_S = 0.05
# Scrapes an interval stays open for while the backend's count and ours disagree: one for a
# request's end on its way to the gateway at a scrape, a few for those of a burst.
MAX_MERGED_SCRAPES = 3


@dataclass(frozen=True, slots=True)
class DispatchTiming:
    """What `gateway.proxy.attempts.first_byte` saw of one attempt.

    Attributes:
        sent_s: ``gw.clock()`` when it was sent.
        ahead: (sent_s, estimated T) of each request of this gateway's there before its first byte then.
        overtaken: a request was sent there after it, before its first byte.
        headers_s: ``gw.clock()`` when its response headers arrived.
        stream: a streamed request.
    """

    sent_s: float
    ahead: tuple[tuple[float, int], ...]
    overtaken: bool
    headers_s: float
    stream: bool

    def prefilled_alone(self, uncached_prompt_tokens: int, step_tokens: int) -> bool:
        """No other prefill shared its engine steps, at ``step_tokens`` per step (module docstring)."""
        if len(self.ahead) > 1:
            return False
        if self.ahead:
            sent_s, new_tokens = self.ahead[0]
            if new_tokens > step_tokens or self.sent_s - sent_s < QUEUE_SETTLE_S:
                return False
        return not (self.overtaken and uncached_prompt_tokens > step_tokens)


def single_step_tokens(spec: BackendSpec) -> int:
    """`SINGLE_STEP_TOKENS_ESTIMATE` for the backend's GPU."""
    hw = spec.hardware
    large = hw.hbm_gib >= LARGE_GPU_HBM_GIB and "a100" not in hw.name.lower()
    return SINGLE_STEP_TOKENS_ESTIMATE["large" if large else "other"]


@dataclass
class PrefillFeed:
    """One backend's requests between two scrapes, for its κ_crit fit (module docstring).

    ``pending`` holds, in order, a prediction for each request that completed there since the
    interval began, and None for each that the fit cannot predict or that ended otherwise.
    """

    pending: list[PrefillPrediction | None] = field(default_factory=list)
    completed: int = 0  # this gateway's requests completed there, cumulative
    _last: tuple[float, float, float] | None = None  # (count, sum s, count − completed) where the interval began
    _carried: list[PrefillPrediction | None] = field(default_factory=list)  # an open interval's requests (`scraped`)
    _merged: int = 0  # scrapes the open interval has spanned
    _sent: int = 0  # attempts sent there, cumulative (a sequence number)
    _awaiting: dict[int, tuple[float, int]] = field(default_factory=dict)  # before their first byte

    def sent(self, sent_s: float, uncached_prompt_tokens: int) -> tuple[int, tuple[tuple[float, int], ...]]:
        """An attempt is sent there now: its sequence number and the attempts before their first byte."""
        ahead = tuple(self._awaiting.values())
        self._sent += 1
        self._awaiting[self._sent] = (sent_s, uncached_prompt_tokens)
        return self._sent, ahead

    def answered(self, sequence: int) -> bool:
        """Its first byte came; returns whether another attempt was sent there since."""
        self._awaiting.pop(sequence, None)
        return self._sent != sequence

    def failed(self, sequence: int) -> None:
        """It ended before its first byte (the engine aborts it, or never saw it)."""
        self._awaiting.pop(sequence, None)
        self.ended_otherwise()

    def ended_otherwise(self) -> None:
        """A request there ended without completing (client gone, upstream failure): the engine
        may have shared steps with it, so the interval it ends in cannot be attributed."""
        self.pending.append(None)

    def completed_request(self, prediction: PrefillPrediction | None) -> bool:
        """A request completed there (``None``: one the fit cannot predict). Returns whether an
        early scrape would help: after an unpredictable request (the requests finishing next then
        fall in another interval than the one it spoils) or a load-bound one (the scarce kind:
        the fewer requests share its interval, the less likely one spoils it)."""
        self.pending.append(prediction)
        self.completed += 1
        return prediction is None or prediction.t_load_s > max(prediction.t_compute_s, prediction.t_hbm_s)

    def scraped(self, count: float | None, sum_s: float, *, end_s: float = 0.0) -> PrefillInterval | None:
        """Close the interval at a scrape of the histogram's ``_count`` and ``_sum``; its sample or None.

        Args:
            count, sum_s: the scraped ``vllm:request_prefill_time_seconds`` ``_count`` and ``_sum``
                (count None: the backend does not export it), applied when the scrape's answer
                is read: the interval holds the requests that completed here until then.
            end_s: now, on the caller's clock (the interval's age in the fit, `router.kappa_fit`).

        When the backend's count minus ours moved (a request's end was on its way to the gateway
        at the scrape, or reached it first), the interval stays open: its requests and the sum
        it started from carry over to the next scrape, for up to `MAX_MERGED_SCRAPES` scrapes,
        until the counts agree again (a merged interval is a sum like any other). One that
        still disagrees then (another client's requests there) is dropped and the count starts
        afresh.
        """
        pending = self._carried + self.pending
        self.pending, self._carried = [], []
        if count is None:
            self._last, self._merged = None, 0
            return None
        last, diff = self._last, count - self.completed
        if last is None or count < last[0]:  # the first scrape, or a restart
            self._last, self._merged = (count, sum_s, diff), 0
            return None
        if diff != last[2] and self._merged < MAX_MERGED_SCRAPES:
            self._carried, self._merged = pending, self._merged + 1
            return None
        self._last, self._merged = (count, sum_s, diff), 0
        if diff != last[2] or not pending or None in pending:
            return None
        return PrefillInterval(sum_s - last[1], tuple(p for p in pending if p is not None), end_s)


def prediction(spec: BackendSpec, candidate: Candidate, timing: DispatchTiming,
               usage: dict[str, Any] | None) -> PrefillPrediction | None:
    """The profile's prediction for a request that completed on the backend of ``spec``, or None
    when it does not count (module docstring)."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(prompt, int) or not isinstance(cached, int) or not 0 <= cached < prompt:
        return None
    if not timing.prefilled_alone(prompt - cached, single_step_tokens(spec)):
        return None
    estimated = candidate.cached_tokens
    if abs(estimated - cached) > max(CACHED_TOKENS_TOLERANCE, CACHED_TOKENS_TOLERANCE_RATIO * prompt):
        return None
    scale = cached / estimated if estimated else 0.0
    host = candidate.cached_host_tokens * scale
    kv_pool = candidate.cached_kv_pool_tokens * scale
    if kv_pool and not spec.kv_pool_link_bytes_per_s:
        return None
    return PrefillPrediction.of(spec, cached_hbm_tokens=cached - host - kv_pool, cached_host_tokens=host,
                                cached_kv_pool_tokens=kv_pool, uncached_prompt_tokens=prompt - cached)
