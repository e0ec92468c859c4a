"""What a simulated run records: each decision for an observer, each request's fate, the run's result.

Kept apart from `sim.simulator` (which re-exports them) so the event loop stays one module's size.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from router.types import BackendView, Decision, RequestFeatures
from sim.fleet import SimBackend

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    """What the router was given and what it chose, for an observer (tests, traces of decisions)."""

    now_s: float
    request_index: int
    features: RequestFeatures
    views: tuple[BackendView, ...]
    decision: Decision


DecisionObserver = Callable[[DecisionEvent], None]


@dataclass(slots=True)
class RequestRecord:
    """One request's fate. Times in virtual seconds; token counts as the engine reported them.

    ``kappa_ratio``, ``kappa_ratio_loaded``, ``kappa_crit``, ``regime`` and ``predicted_ttft_s``
    are the chosen candidate's figures at decision time (what the gateway puts in its
    x-kappa-* headers; names as in `router.kappa`). A split request (P/D) is timed at its decode
    backend (first token and finish there); its prompt and cached tokens are its prefill's (what was
    computed), its transfer what the decode backend pulled.
    """

    index: int
    arrival_s: float
    backend_id: str
    max_tokens: int
    kappa_ratio: float
    kappa_ratio_loaded: float
    kappa_crit: float
    regime: str
    predicted_ttft_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0
    cached_kv_pool_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    prefill_backend_id: str | None = None  # split (P/D): prefilled there, decoded on ``backend_id``
    prefill_done_s: float | None = None  # split: the prefill's one token came back
    transfer_tokens: int = 0  # split: prompt tokens whose KV the decode backend pulled, P − K_d
    transfer_s: float = 0.0  # split: the pull's seconds over the delivered link

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's run over one trace and fleet.

    Args:
        policy: the policy's name.
        records: one per routed request, by trace index.
        rejected: trace indexes the chosen backend refused (prompt + max_tokens over its context),
            answered with an error as the gateway would relay vLLM's 400; not in ``records``.
        start_s, end_s: first arrival and last finish, s.
        energy_j: joules per backend id over [start_s, end_s], idle included.
        backends: the fleet's backends, in config order.
        wall_s: wall-clock seconds the run took.
        measured: per backend id, what its fit measured by the end (`sim.measure.measured_figures`;
            empty when the fleet's measurement is disabled).
    """

    policy: str
    records: list[RequestRecord]
    rejected: list[int]
    start_s: float
    end_s: float
    energy_j: dict[str, float]
    backends: tuple[SimBackend, ...]
    wall_s: float
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends, without an event loop.

    Raises:
        RuntimeError: the coroutine suspended (it needs real I/O; use an event loop).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("coroutine suspended: the simulator needs a prefix index that never awaits")
