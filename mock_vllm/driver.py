"""Runs the step-driven `MockEngine` in real time for the HTTP server.

The engine is pure: it never reads a clock, it is told when each step starts and says how
long the step takes. `EngineDriver.run` is the loop that gives it time:

    engine_now = (monotonic() − t0) / time_scale
    start      = the waking request's arrival (engine_now), after idling;
                 the previous step's end, while busy
    result     = engine.step(start)
    sleep until t0 + result.end_s · time_scale, then hand each output to its request's queue

and, when the engine has nothing to do, awaits an event that `submit` sets. With
``time_scale`` 0.01 the modelled GPU runs 100× faster than real time; histograms stay in
engine seconds (`mock_vllm.metrics`).

While busy, steps run back to back in engine time, as a GPU with queued work does. Starting
each step at ``max(engine_now, previous end)`` instead would turn every late wake-up (event
loop timers fire late, and streams' writes share the loop) into modelled GPU idle time, scaled
up by 1 / time_scale (at time-scale 0.01 a wake-up 1 ms late is 100 ms of engine time), and the
task switch from a request's handler to this loop would add to every idle request's TTFT. So
lateness stays in wall time, where ``mock_vllm:schedule_lag_seconds`` (largest recent
delay) and ``mock_vllm:step_lag_seconds`` (histogram) report it; a request that arrives
while the driver is behind is stamped with the engine time the loop has reached (the next
step's start), so engine-time latencies stay causal. Lag that keeps growing means this
process cannot serve that many streams at that time scale. Everything here runs on the
event loop's thread; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mock_vllm.metrics import MockVllmMetrics, RequestTiming
from mock_vllm.types import RequestOutput, StepResult

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mock_vllm.engine import MockEngine


# A request's outputs in order; an `EngineDead` in place of an output if the loop fails.
OutputQueue = asyncio.Queue[RequestOutput | BaseException]


class EngineDead(RuntimeError):
    """The driver loop stopped on an engine exception; the server can serve no more requests."""


class EngineClock:
    """Engine seconds from the monotonic wall clock: ``(monotonic() − t0) / time_scale``.

    Args:
        time_scale: wall seconds per engine second, > 0 (0.01 = 100× faster than real time).
    """

    def __init__(self, time_scale: float) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = time_scale
        self._t0 = time.monotonic()

    def start(self) -> None:
        """Make engine time 0 now (the server calls it when it starts serving)."""
        self._t0 = time.monotonic()

    def now_s(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    def wall_of(self, engine_s: float) -> float:
        """The `time.monotonic` value at which engine time ``engine_s`` is due."""
        return self._t0 + engine_s * self.time_scale


@dataclass(slots=True)
class _Tracked:
    timing: RequestTiming
    outputs: OutputQueue = field(default_factory=asyncio.Queue)


class EngineDriver:
    """Owns the engine for the server: admits and aborts requests, runs the step loop."""

    def __init__(self, engine: MockEngine, clock: EngineClock, metrics: MockVllmMetrics,
                 on_kv_held: Callable[[str, int], None] | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self._after_step = after_step  # called as each step is taken (KV events: `mock_vllm.kv_events`)
        self._on_kv_held = on_kv_held  # a finished request kept its KV blocks (P/D: `mock_vllm.pd`)
        self._clock = clock
        self._metrics = metrics
        self._tracked: dict[str, _Tracked] = {}
        self._wake = asyncio.Event()
        self._failure: BaseException | None = None
        self._busy = False  # the engine has work: steps follow each other back to back
        self._cursor_s = 0.0  # engine time the loop has reached: the next step's start

    @property
    def failure(self) -> BaseException | None:
        """The exception that stopped the loop, or ``None`` while it is healthy."""
        return self._failure

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], *, max_tokens: int,
               cache_salt: str | None, hold_kv: bool = False, remote_from_block: int | None = None,
               arrived_s: float | None = None) -> OutputQueue:
        """Add a request to the engine; its outputs (or an `EngineDead`) arrive on the returned queue.

        ``hold_kv``, ``remote_from_block``: P/D (`MockEngine.add_request`). ``arrived_s``: when the
        request reached the server, engine seconds, if earlier than now (a decode that pulled its
        KV first: its TTFT and latencies count from there, as vLLM's decode side counts them).

        Raises:
            mock_vllm.engine.PromptTooLong: prompt + max_tokens exceed max_model_len.
            mock_vllm.engine.DuplicateRequest: ``request_id`` is in use.
            EngineDead: the driver loop has failed.
        """
        if self._failure is not None:
            raise EngineDead("the mock engine loop has stopped") from self._failure
        now_s = self._clock.now_s()
        arrival_s = min(now_s, self._cursor_s) if self._busy else max(now_s, self._cursor_s)  # module docstring
        self._engine.add_request(request_id, prompt_token_ids, max_tokens=max_tokens, arrival_s=arrival_s,
                                 cache_salt=cache_salt, hold_kv=hold_kv, remote_from_block=remote_from_block)
        if not self._busy:
            self._busy, self._cursor_s = True, arrival_s
        tracked = _Tracked(RequestTiming(arrival_s=arrival_s if arrived_s is None else min(arrived_s, arrival_s)))
        self._tracked[request_id] = tracked
        self._wake.set()
        return tracked.outputs

    def abort(self, request_id: str) -> None:
        """Stop a request that has not finished (client gone); a no-op once it has."""
        if self._tracked.pop(request_id, None) is not None:
            self._engine.abort(request_id)

    async def run(self) -> None:
        """The step loop (module docstring); runs until cancelled.

        An exception from the engine ends the loop: every waiting request receives an
        `EngineDead`, later submissions raise it, and the exception propagates to whoever
        awaits this task (the lifespan, at shutdown).
        """
        try:
            await self._loop()
        except Exception as exc:  # any engine failure: fail every waiter, then re-raise
            self._failure = exc
            dead = EngineDead(f"the mock engine loop stopped: {exc!r}")
            for tracked in self._tracked.values():
                tracked.outputs.put_nowait(dead)
            self._tracked.clear()
            raise

    async def _loop(self) -> None:
        while True:
            if not self._engine.has_unfinished():
                self._busy = False
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._busy:
                self._busy, self._cursor_s = True, max(self._clock.now_s(), self._cursor_s)
            result = self._engine.step(self._cursor_s)
            if self._after_step is not None:  # vLLM publishes a step's KV events as it schedules it
                self._after_step()
            self._cursor_s = result.end_s
            due = self._clock.wall_of(result.end_s)
            # sleep(0) when late still yields, so handlers and streams run between steps.
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            self._metrics.on_step(lag_s=time.monotonic() - due, step_wall_s=result.duration_s * self._clock.time_scale)
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        for output in result.outputs:
            if output.kv_held_blocks and self._on_kv_held is not None:  # held even if its client left
                self._on_kv_held(output.request_id, output.kv_held_blocks)
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted while its step ran
                continue
            self._metrics.on_output(tracked.timing, result, output)
            tracked.outputs.put_nowait(output)
            if output.finished:
                del self._tracked[output.request_id]
