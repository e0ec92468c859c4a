"""What an engine's prefill-time sum contains when prefills share steps: vLLM's chunked-prefill schedule,
replayed on the gateway's own requests to one backend.

vLLM's v1 scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``) fills each step
with a token budget (``max_num_batched_tokens``): the running requests first — one token for each
decode, the next chunk of a prefill that did not fit — then the waiting ones, first come first
served, each with as much of its prompt as the budget has left. A request's prefill time
(``vllm:request_prefill_time_seconds``: from the step that first schedules it to the one that
ends its prompt) therefore holds every step its chunks run in, whole, whoever else shares them.

**The replay.** Requests are packed in the order the gateway sent them (the engine's arrival
order): a request's first chunk joins the last step laid out (the *tail*) when the tail has budget
left and the request was sent before the tail began — it was waiting when that step was scheduled —
and begins a step of its own otherwise; its other chunks take whole steps. The tail began at its
end (the first token of the request whose prompt it ends, which the gateway sees) less its
duration at the fit's current factors. A request's tokens are known when it completes (``usage``:
T = prompt − cached), so packing waits for each request in turn; its cached tokens are split by
tier as the index estimated them (`dispatch.prefill_feed.tiers`). Each step is then priced on the
profile as the engine steps it (`router.cost.roofline`: FLOPs of each chunk at its context, the
host-tier and pool loads of the requests it admits, weights and KV read from HBM, the decodes
the gateway has running there), and a request's prefill is the sum over its steps of
max(u·compute, v_host·host + v_pool·pool, w·HBM) — linear in the factors once each step's
binding term is drawn, as `router.kappa_fit` fits.

**What spoils a step** (the intervals whose requests ran in it are not fitted): a request in it
whose cached tokens the index did not foresee (which tier they came from is unknown), or one that
ended without usage (its tokens are unknown); after such a request, or one without a first-token
time (a non-streamed answer), every step until the engine is next seen free of the gateway's
prefills (a request sent after the tail's end, or after the unknown one finished), since the
chunk boundaries that follow depend on it.

Not modelled, so not fitted where it happens: other clients' requests (`dispatch.prefill_feed`
drops their intervals by the engine's count), preemption (KV full), and a budget other than the
estimate (`dispatch.prefill_feed.single_step_tokens`). Times are the caller's clock; in the
gateway a wall clock, in which an engine that runs ``--time-scale`` faster than real (the mock)
shortens the steps: the factors the fit measures are engine seconds over profiled ones, so
``wall_per_engine_s`` converts them, learnt from the requests that ran alone (`SCALE_WINDOW`; about
1 for a real engine).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from router import kappa
from router.cost import BackendSpec, roofline
from dispatch.tier_check import LoadedTokensCheck
from router.kappa_fit import PrefillInterval, PrefillPrediction

MAX_PENDING_INTERVALS = 64  # closed intervals waiting for their neighbours' usage; the oldest go first
# Two first tokens of one step reach the gateway this close (the same step's outputs; live, one event
# loop's delivery apart).
SAME_STEP_S = 0.002
# A first token later than its chunks could take in full steps, by this factor, came after a wait.
KV_WAIT_MARGIN = 1.2
# Wall seconds per engine second (`PrefillSchedule.wall_per_engine_s`): the SCALE_QUANTILE quantile, over
# the latest SCALE_WINDOW requests that found the engine free of prefills, of their time to first token
# over their steps' seconds at the fit's factors (a low quantile: waits for a step in progress, for KV,
# and the network only ever lengthen the first); 1 until MIN_SCALE_SAMPLES of them.
SCALE_WINDOW = 64
MIN_SCALE_SAMPLES = 5
SCALE_QUANTILE = 0.2


@dataclass(slots=True, eq=False)
class _Entry:
    """One request sent there: what the gateway saw of it."""

    sequence: int
    sent_s: float
    first_token_s: float | None = None
    finished_s: float | None = None
    tokens: tuple[int, int] | None = None  # (prompt, cached) from usage, once completed
    tiers: tuple[float, float, float] | None = None  # cached tokens in (HBM, host tier, pool), None: unknown
    ended: bool = False
    packed: bool = False
    steps: list[_Step] = field(default_factory=list)
    admitted_s: float | None = None  # when its first step began, once its steps are closed
    admitted_margin_s: float = 0.0
    fresh: bool = False  # laid out on an engine free of the gateway's prefills: its steps its own
    verified: bool | None = None  # its tiers agree with the engine's loaded-token count (`dispatch.tier_check`)

    @property
    def loaded_tokens(self) -> float | None:
        """Host-tier and pool tokens the index says it loaded (None: unknown)."""
        return None if self.tiers is None else self.tiers[1] + self.tiers[2]


@dataclass(slots=True, eq=False)
class _Step:
    """One engine step laid out by the replay: its prefill chunks (entry, tokens, context, first chunk)."""

    tokens: int
    budget: int
    chunks: list[tuple[_Entry, int, int, bool]] = field(default_factory=list)
    decode_contexts: tuple[int, ...] = ()
    end_s: float | None = None
    spoiled: bool = False
    closed: bool = False
    term: PrefillPrediction | None = None


class PrefillSchedule:
    """The replay of one backend's chunked-prefill schedule (module docstring).

    Args:
        spec: the backend's profile (steps are priced on it).
        step_tokens: the engine's token budget per step (`dispatch.prefill_feed.single_step_tokens`).
    """

    def __init__(self, spec: BackendSpec, step_tokens: int) -> None:
        self.spec, self.step_tokens = spec, step_tokens
        self.wall_per_engine_s = 1.0  # the median of `_scales` once it holds MIN_SCALE_SAMPLES
        self._scales: deque[float] = deque(maxlen=SCALE_WINDOW)
        self._c = kappa.model_constants(spec.model)
        self._entries: dict[int, _Entry] = {}
        self._unpacked: deque[_Entry] = deque()
        self._tail: _Step | None = None
        self._spoiled_run = False  # the chunk boundaries since the last free engine are unknown
        self._unknown_until_s = -math.inf  # a request without usage may have run until then
        self._intervals: deque[tuple[float, tuple[int, ...], float]] = deque()
        self._check = LoadedTokensCheck()

    # -- what the gateway reports ------------------------------------------------------------------------
    def sent(self, sequence: int, sent_s: float) -> None:
        """A request was sent there at ``sent_s``."""
        entry = _Entry(sequence, sent_s)
        self._entries[sequence] = entry
        self._unpacked.append(entry)

    def first_token(self, sequence: int, now_s: float) -> None:
        """Its first token came back (a stream's first byte)."""
        entry = self._entries.get(sequence)
        if entry is not None and entry.first_token_s is None:
            entry.first_token_s = now_s

    def completed(self, sequence: int, tokens: tuple[int, int] | None, tiers: tuple[float, float, float] | None,
                  now_s: float) -> None:
        """It ended at ``now_s``: with usage (prompt, cached tokens) and its cached tokens by tier (None:
        not foreseen by the index), or without usage (``tokens`` None: failed, or no usage reported)."""
        entry = self._entries.get(sequence)
        if entry is not None:
            entry.tokens, entry.tiers, entry.finished_s, entry.ended = tokens, tiers, now_s, True

    def loaded(self, now_s: float, loaded_tokens_total: float | None) -> None:
        """A scrape read the engine's loaded-token counter (`dispatch.tier_check`; None: not exported)."""
        self._check.scraped(now_s, loaded_tokens_total)

    def interval(self, prefill_s: float, sequences: tuple[int, ...], end_s: float) -> None:
        """A closed interval of the histogram (`dispatch.prefill_feed.PrefillFeed.scraped`): the summed
        prefill seconds of these requests, to be attributed once their steps are laid out."""
        self._intervals.append((prefill_s, sequences, end_s))
        while len(self._intervals) > MAX_PENDING_INTERVALS:
            self._intervals.popleft()

    # -- the replay ----------------------------------------------------------------------------------------
    def ready(self, rates: tuple[float, float, float, float], now_s: float,
              keep: frozenset[int] = frozenset()) -> list[PrefillInterval]:
        """Lay out every request whose usage is in, then the intervals whose steps are all closed, in order:
        one `router.kappa_fit.PrefillInterval` each, one term per step of each of its requests (a step two
        of them ran in is in both prefill times). Spoiled intervals are dropped. ``rates``: the fit's
        factors (COMPUTE, HOST, POOL, HBM), for the tails' durations; ``keep``: requests of an interval
        not closed yet (the caller's), whose layout must be kept."""
        self._pack(rates, now_s)
        self._settle(now_s)
        out: list[PrefillInterval] = []
        while self._intervals:
            prefill_s, sequences, end_s = self._intervals[0]
            entries = [self._entries.get(s) for s in sequences]
            if any(e is not None and not (e.packed and all(step.closed for step in e.steps)) for e in entries):
                break  # a request of it is not laid out yet, or its last step may still take others
            steps = [step for e in entries if e is not None for step in e.steps]
            if None in entries or any(e is not None and not e.steps for e in entries) or any(
                    step.term is None for step in steps):
                self._intervals.popleft()  # spoiled
                continue
            loaders = [entry for step in steps for entry, _, _, first in step.chunks if first]
            if any(e.verified is None for e in loaders):
                break  # the engine's count of loaded tokens has not checked their tiers yet
            self._intervals.popleft()
            if all(e.verified for e in loaders):
                out.append(PrefillInterval(prefill_s, tuple(step.term for step in steps if step.term), end_s))
        self._prune(keep)
        return out

    def _settle(self, now_s: float) -> None:
        """Check the tiers of the requests laid out against the engine's count (`dispatch.tier_check`),
        up to the earliest admission of one not yet laid out."""
        known_until = self._unpacked[0].sent_s if self._unpacked else now_s
        tail = self._tail
        if tail is not None and not tail.closed:
            known_until = min([known_until, *(e.sent_s for e, _, _, _ in tail.chunks)])
        self._check.settle([e for e in self._entries.values() if e.packed and e.verified is None
                            and all(step.closed for step in e.steps)], known_until)

    def _pack(self, rates: tuple[float, float, float, float], now_s: float) -> None:
        while self._unpacked and self._unpacked[0].ended:
            entry = self._unpacked.popleft()
            self._place(entry, rates)
        tail = self._tail
        if tail is not None and not tail.closed and not self._unpacked and tail.end_s is not None and now_s > tail.end_s:
            self._close(tail, rates)  # nothing waiting was sent before it ended: nothing more joins it

    def _place(self, entry: _Entry, rates: tuple[float, float, float, float]) -> None:
        """Lay out one request's chunks after the earlier ones' (module docstring)."""
        entry.packed = True
        tail = self._tail
        fresh = (tail is None or self._free_before(tail, entry.sent_s)) and entry.sent_s >= self._unknown_until_s
        if fresh:
            self._spoiled_run = False
        entry.fresh = fresh
        if entry.tokens is None:  # its tokens are unknown: so are the chunk boundaries after it
            self._spoiled_run = True
            self._unknown_until_s = max(self._unknown_until_s, entry.finished_s or math.inf)
            if tail is not None and not fresh:
                tail.spoiled = True  # it may have run in it
            return
        prompt, cached = entry.tokens
        remaining, context = max(prompt - cached, 1), cached
        at_s = entry.first_token_s if entry.first_token_s is not None else entry.sent_s
        decodes = self._decoding(at_s)
        budget = max(self.step_tokens - len(decodes), 1)
        room = 0 if fresh or tail is None else max(tail.budget - tail.tokens, 0)
        if tail is not None and room and self._joins(tail, entry, remaining, context, room, budget, decodes, rates):
            chunk = min(remaining, room)
            self._add(tail, entry, chunk, context, True)
            remaining, context = remaining - chunk, context + chunk
        while remaining > 0:
            if self._tail is not None:
                self._close(self._tail, rates)
            step = self._tail = _Step(0, budget, decode_contexts=decodes)
            chunk = min(remaining, budget)
            self._add(step, entry, chunk, context, not entry.steps)
            remaining, context = remaining - chunk, context + chunk
        entry.steps[-1].end_s = entry.first_token_s
        if self._spoiled_run:
            for step in entry.steps:
                step.spoiled = True
        if entry.first_token_s is None:  # where its last step ended is unknown: whether the next joined it too
            self._spoiled_run = True

    def _joins(self, tail: _Step, entry: _Entry, tokens: int, context: int, room: int, budget: int,
               decodes: tuple[int, ...], rates: tuple[float, float, float, float]) -> bool:
        """Whether its first chunk ran in the tail, which had ``room`` tokens of budget left.

        A prompt that fits the room joined exactly when its first token came with the tail's end
        (within `SAME_STEP_S`, or half the step it would have taken on its own, whichever is longer:
        live, two outputs of one step reach the gateway some milliseconds apart). Else: when it was sent before the tail began (the tail's
        end less its duration at ``rates``), unless its first token came later than its remaining chunks
        could take even in full steps (`KV_WAIT_MARGIN`): then it waited for KV, not budget, and began
        later on its own."""
        scale = self.wall_per_engine_s
        if tail.end_s is not None and entry.first_token_s is not None and tokens <= room:
            own_s = self._steps_s(entry, tokens, context, budget, decodes, rates, first=True, loads=False) * scale
            return abs(entry.first_token_s - tail.end_s) <= max(SAME_STEP_S, 0.5 * own_s)
        start = self._start(tail, rates)
        if start is None:  # the tail's duration is unknown: whether this joined it is too
            self._spoiled_run = True
            return False
        if entry.sent_s >= start:
            return False
        if tail.end_s is None or entry.first_token_s is None:
            return True
        rest = tokens - room
        full = self._steps_s(entry, budget * -(-rest // budget), context + room, budget, decodes, rates, first=False)
        return entry.first_token_s - tail.end_s <= full * scale * KV_WAIT_MARGIN + SAME_STEP_S

    def _steps_s(self, entry: _Entry, tokens: int, context: int, budget: int, decodes: tuple[int, ...],
                 rates: tuple[float, float, float, float], *, first: bool, loads: bool = True) -> float:
        """Seconds of the steps ``tokens`` of it take on their own at ``rates``, from ``context`` on (its
        loads left out with ``loads`` False: the least they take, whatever tier its cached tokens were in)."""
        total = 0.0
        while tokens > 0:
            step = _Step(0, budget, decode_contexts=decodes)
            chunk = min(tokens, budget)
            step.chunks.append((entry, chunk, context, first))
            step.tokens = chunk
            total += self._duration(step, rates, loads=loads and entry.tiers is not None)
            tokens, context, first = tokens - chunk, context + chunk, False
        return total

    def _free_before(self, tail: _Step, sent_s: float) -> bool:
        """Whether the engine had finished every earlier prefill of the gateway's when this was sent."""
        if tail.end_s is not None:
            return sent_s >= tail.end_s
        ends = [e.finished_s for e, _, _, _ in tail.chunks if e.finished_s is not None]
        return bool(ends) and sent_s >= max(ends)  # no first-token time: its finish bounds it

    def _start(self, tail: _Step, rates: tuple[float, float, float, float]) -> float | None:
        """When the tail began: its end less its duration at ``rates`` (None: unknown)."""
        if tail.end_s is None or tail.spoiled:
            return None
        return tail.end_s - self._duration(tail, rates) * self.wall_per_engine_s

    def _duration(self, step: _Step, rates: tuple[float, float, float, float], *, loads: bool = True) -> float:
        """A step's engine seconds at ``rates`` (its loads left out where a request's tiers are unknown, or
        when ``loads`` is False)."""
        term = (loads and self._term(step)) or self._term(step, loads=False)
        if term is None:
            return 0.0
        c, host, pool, hbm = term.columns()
        return max(rates[0] * c, rates[1] * host + rates[2] * pool, rates[3] * hbm)

    def _add(self, step: _Step, entry: _Entry, tokens: int, context: int, first: bool) -> None:
        step.chunks.append((entry, tokens, context, first))
        step.tokens += tokens
        entry.steps.append(step)
        if first and entry.tiers is None:
            step.spoiled = True

    def _decoding(self, at_s: float) -> tuple[int, ...]:
        """Prompt lengths of the gateway's requests decoding there at ``at_s`` (first token before, not finished)."""
        return tuple(e.tokens[0] if e.tokens else 0 for e in self._entries.values()
                     if e.first_token_s is not None and e.first_token_s < at_s - SAME_STEP_S
                     and (e.finished_s is None or e.finished_s > at_s))

    def _close(self, step: _Step, rates: tuple[float, float, float, float]) -> None:
        """No chunk joins it any more: price it, and time the admission of each request whose last step it is."""
        if step.closed:
            return
        step.closed = True
        step.term = None if step.spoiled else self._term(step)
        scale = self.wall_per_engine_s
        for entry, _, _, _ in step.chunks:
            if entry.steps[-1] is not step:
                continue
            if entry.first_token_s is None:  # not streamed: admitted between its send and its end
                end_s = entry.finished_s if entry.finished_s is not None else entry.sent_s
                entry.admitted_s, entry.admitted_margin_s = (entry.sent_s + end_s) / 2, (end_s - entry.sent_s) / 2
                continue
            first = entry.steps[0]
            first_s = self._duration(first, rates) * scale
            own_s = sum(self._duration(x, rates) for x in entry.steps)
            estimate = first.end_s - first_s if first.end_s is not None else entry.first_token_s - own_s * scale
            margin = 0.1 * first_s + SAME_STEP_S
            low, high = max(entry.sent_s, estimate - margin), min(entry.first_token_s, estimate + margin)
            if low > high:  # the estimate is off (the scale not learnt yet): it was admitted between the two
                low, high = entry.sent_s, entry.first_token_s
            entry.admitted_s, entry.admitted_margin_s = (low + high) / 2, (high - low) / 2
            if entry.fresh and own_s > 0:
                self._scales.append((entry.first_token_s - entry.sent_s) / own_s)
                if len(self._scales) >= MIN_SCALE_SAMPLES:
                    self.wall_per_engine_s = sorted(self._scales)[int(SCALE_QUANTILE * len(self._scales))]

    def _term(self, step: _Step, *, loads: bool = True) -> PrefillPrediction | None:
        """The step's seconds by resource on the profile, as the engine steps it (`router.cost.roofline`);
        None when a request it admits has unknown tiers (unless ``loads`` is False: its loads left out)."""
        c, flops, kv_read, host, pool = self._c, 0.0, 0.0, 0.0, 0.0
        for entry, tokens, context, first in step.chunks:
            flops += c.prefill_flops(context, tokens)
            kv_read += c.kv_bytes(context)
            if first:
                if entry.tiers is None:
                    if loads:
                        return None
                    continue
                _, host_tokens, pool_tokens = entry.tiers
                host += c.kv_bytes(host_tokens) if host_tokens else 0.0
                pool += c.kv_bytes(pool_tokens) if pool_tokens else 0.0
        for context in step.decode_contexts:
            flops += c.prefill_flops(context, 1)
            kv_read += c.kv_bytes(context)
        if pool and not self.spec.kv_pool_link_bytes_per_s:
            return None
        weights = c.weights_read_bytes(step.tokens + len(step.decode_contexts))
        r = roofline(self.spec, flops=flops, hbm_bytes=weights + kv_read, host_load_bytes=host, kv_pool_load_bytes=pool)
        pool_s = pool / self.spec.kv_pool_link_bytes_per_s if pool else 0.0
        return PrefillPrediction(r.compute_s, r.load_s, r.hbm_s, pool_s)

    def _prune(self, keep: frozenset[int]) -> None:
        """Forget requests that finished and that no interval (waiting here, or still open: ``keep``) or
        unpacked request needs."""
        needed = {s for _, sequences, _ in self._intervals for s in sequences} | keep
        keep_from = self._unpacked[0].sent_s if self._unpacked else math.inf
        for seq in [s for s, e in self._entries.items() if e.packed and s not in needed
                    and all(step.closed for step in e.steps) and (e.finished_s or 0.0) < keep_from]:
            del self._entries[seq]
