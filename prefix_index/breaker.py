"""A circuit breaker around the prefix index: a frozen store costs a few requests, not an outage.

Without it, while Redis is frozen (SIGSTOP, a stuck host, a partition that drops packets)
every request waits out the index deadline before it is routed without prefix matches:
+55 ms on every request for the whole outage (issue 16). The breaker is the usual state
machine (Nygard, *Release It!*, "Circuit Breaker"; resilience4j's count-based
``CircuitBreaker`` with one permitted call when half-open), with a wait that grows while
the outage lasts, as Envoy's outlier ejection time does; over the index's ``match`` calls:

- **closed**: calls go through; ``failure_threshold`` consecutive failed matches
  (``IndexUnavailable``: timeout, refused, Redis error) open it;
- **open** for ``open_s``: every call is skipped at once with ``IndexCircuitOpen``, which
  the routing pipeline treats as "no match" (load-only routing) and counts as a skip;
- **half-open** once ``open_s`` has passed: exactly one match goes to the store as the
  probe, the rest are still skipped. The probe's success closes the breaker; its failure
  opens it again for twice as long, up to ``max_open_s``; a probe whose caller gave up
  (cancelled) leaves it open with the next call as the new probe.

Only matches drive it. They are on every request's path, so an outage shows in them
first, and they are never shed by the gateway itself; a record can time out while queued
behind a slow record batch (`redis_batch`), which says the store is busy, not down.
While the breaker is not closed, ``record``, ``forget`` and ``stats`` are skipped too
(``IndexCircuitOpen``). A skipped ``forget`` (a backend restarted during the outage) is
owed: it runs before the next record once the breaker has closed, and until it has run,
matches report nothing cached on that backend (its cache is empty since the restart), so
the index's old entries for it are never used.

`CircuitBreaker` is pure (time comes in as ``now_s``) and table-tested without a loop;
`BreakerIndex` wraps any ``PrefixIndex`` with one, on an injected clock. The simulator's
in-memory index needs neither.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable, Mapping, Sequence

from prefix_index.base import NO_MATCH, BlockMatch, IndexStats, PrefixIndex, TierCapacity
from prefix_index.errors import IndexCircuitOpen, IndexUnavailable

__all__ = ["Admission", "BreakerIndex", "BreakerState", "CircuitBreaker", "DEFAULT_FAILURE_THRESHOLD",
           "DEFAULT_MAX_OPEN_S", "DEFAULT_OPEN_S"]

# Three failed matches in a row: one slow command or a lost packet does not open it, and at
# ~55 ms per failed match a request rate of 1/s still opens it within ~3 s of an outage's start
# (at the load of bench/faults.py, ~55 req/s, within ~0.1 s).
DEFAULT_FAILURE_THRESHOLD = 3
# Skip the index 1 s before the first probe: a recovered Redis is back in use within ~1 s,
# and a probe costs its request at most the index deadline (55 ms).
DEFAULT_OPEN_S = 1.0
# Each failed probe doubles the wait, up to 4 s: a long outage costs one probe per 4 s per
# gateway, and its end is noticed within 4 s.
DEFAULT_MAX_OPEN_S = 4.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(enum.Enum):
    """What `CircuitBreaker.admit` lets a call do."""

    CALL = "call"  # closed: go ahead
    PROBE = "probe"  # half-open: go ahead, and report the outcome: it decides the state
    SKIP = "skip"  # open or half-open with a probe out: do not call the store


class CircuitBreaker:
    """Consecutive-failure breaker with one half-open probe and a doubling open time.

    Args:
        failure_threshold: consecutive failed calls that open it, >= 1.
        open_s: time open before the first probe, seconds, > 0.
        max_open_s: the cap of the doubled open time, seconds, >= ``open_s``.

    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(self, failure_threshold: int = DEFAULT_FAILURE_THRESHOLD, open_s: float = DEFAULT_OPEN_S,
                 max_open_s: float = DEFAULT_MAX_OPEN_S) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {failure_threshold!r}")
        if not math.isfinite(open_s) or open_s <= 0:
            raise ValueError(f"open_s must be finite and > 0, got {open_s!r}")
        if not math.isfinite(max_open_s) or max_open_s < open_s:
            raise ValueError(f"max_open_s must be finite and >= open_s ({open_s}), got {max_open_s!r}")
        self.failure_threshold, self.open_s, self.max_open_s = failure_threshold, open_s, max_open_s
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive failed calls while closed
        self.opens = 0  # times it opened (from closed or after a failed probe)
        self._open_for_s = open_s
        self._retry_at_s = 0.0

    @property
    def degraded(self) -> bool:
        """True while open or half-open (the ``gateway_index_degraded`` gauge)."""
        return self.state is not BreakerState.CLOSED

    def admit(self, now_s: float) -> Admission:
        """Whether a call may go to the store now; a PROBE must be reported back."""
        if self.state is BreakerState.CLOSED:
            return Admission.CALL
        if self.state is BreakerState.OPEN and now_s >= self._retry_at_s:
            self.state = BreakerState.HALF_OPEN
            return Admission.PROBE
        return Admission.SKIP

    def succeeded(self, admission: Admission, now_s: float) -> None:
        """An admitted call succeeded. Closes the breaker if it was the probe."""
        if admission is Admission.PROBE:
            self.state, self._open_for_s = BreakerState.CLOSED, self.open_s
            self.failures = 0
        elif admission is Admission.CALL and self.state is BreakerState.CLOSED:
            self.failures = 0

    def failed(self, admission: Admission, now_s: float) -> None:
        """An admitted call failed. Opens the breaker at the threshold, or again after a failed
        probe (for twice as long, at most ``max_open_s``). Late failures of calls admitted
        before it opened change nothing."""
        if admission is Admission.PROBE:
            self._open(now_s, min(self._open_for_s * 2, self.max_open_s))
        elif admission is Admission.CALL and self.state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures >= self.failure_threshold:
                self._open(now_s, self.open_s)

    def abandoned(self, admission: Admission, now_s: float) -> None:
        """An admitted call ended without an outcome (cancelled, or refused its input). An
        abandoned probe leaves the breaker open, the next call probing."""
        if admission is Admission.PROBE and self.state is BreakerState.HALF_OPEN:
            self.state, self._retry_at_s = BreakerState.OPEN, now_s

    def _open(self, now_s: float, open_for_s: float) -> None:
        self.state, self._open_for_s, self._retry_at_s = BreakerState.OPEN, open_for_s, now_s + open_for_s
        self.failures = 0
        self.opens += 1


class BreakerIndex:
    """A ``PrefixIndex`` that asks ``index`` only while ``breaker`` lets it (see the module doc).

    Args:
        index: the guarded index (the Redis one).
        breaker: its breaker (the caller may read ``breaker.degraded`` for a gauge).
        clock: monotonic seconds.

    Every method raises what ``index`` raises, plus ``IndexCircuitOpen`` (an
    ``IndexUnavailable``) when skipped.
    """

    def __init__(self, index: PrefixIndex, breaker: CircuitBreaker, clock: Callable[[], float]) -> None:
        self.index, self.breaker, self._clock = index, breaker, clock
        self.owed_forgets: set[str] = set()  # backends whose forget was skipped while open
        self._forgetting = asyncio.Lock()

    async def match(self, model: str, hashes: Sequence[int],
                    capacities: Mapping[str, TierCapacity]) -> dict[str, BlockMatch]:
        """``index.match`` (no match on a backend whose forget is owed), or ``IndexCircuitOpen``
        at once while the breaker is open."""
        if not hashes or not capacities:  # answered without the store: no evidence either way
            return await self.index.match(model, hashes, capacities)
        breaker = self.breaker
        admission = breaker.admit(self._clock())
        if admission is Admission.SKIP:
            raise IndexCircuitOpen("prefix index skipped: its circuit breaker is open")
        try:
            result = await self.index.match(model, hashes, capacities)
        except IndexUnavailable:
            breaker.failed(admission, self._clock())
            raise
        except BaseException:
            breaker.abandoned(admission, self._clock())
            raise
        breaker.succeeded(admission, self._clock())
        if self.owed_forgets:
            return {b: NO_MATCH if b in self.owed_forgets else m for b, m in result.items()}
        return result

    async def record(self, model: str, backend_id: str, hashes: Sequence[int], capacity: TierCapacity) -> None:
        """``index.record`` after any owed forgets; ``IndexCircuitOpen`` while not closed."""
        self._check_closed("record")
        if self.owed_forgets:
            async with self._forgetting:  # concurrent records wait: none may land before its forget
                while self.owed_forgets:
                    owed = next(iter(self.owed_forgets))
                    await self.index.forget(owed)
                    self.owed_forgets.discard(owed)
        await self.index.record(model, backend_id, hashes, capacity)

    async def forget(self, backend_id: str) -> None:
        """``index.forget``; while not closed, ``IndexCircuitOpen`` and the forget is owed."""
        if self.breaker.degraded:
            self.owed_forgets.add(backend_id)
            raise IndexCircuitOpen("prefix index forget skipped (circuit breaker open): it runs once the index "
                                   "answers again")
        await self.index.forget(backend_id)
        self.owed_forgets.discard(backend_id)

    async def stats(self) -> IndexStats:
        """``index.stats``; ``IndexCircuitOpen`` while not closed."""
        self._check_closed("stats")
        return await self.index.stats()

    async def aclose(self) -> None:
        await self.index.aclose()

    def _check_closed(self, op: str) -> None:
        if self.breaker.degraded:
            raise IndexCircuitOpen(f"prefix index {op} skipped: its circuit breaker is open")
