"""The backend set: health checks, vLLM metrics scraping, restart detection.

Health: ``GET /health`` every ``health_interval_s``, and the outcome of every request, decide
which backends are in rotation as Envoy's active health checks and outlier detection do
(`gateway.backends.rotation`, rules in `gateway.backends.outlier`): ``unhealthy_threshold``
failed checks in a row take a backend out; ``consecutive_5xx`` failures in a row eject it
for a time that grows with repeats, never more than ``max_ejection_percent`` of a model's
backends at once; below ``healthy_panic_threshold_percent`` in rotation a model is in panic
mode and its requests go to all its backends. Requests waiting for a backend's first byte
watch its down signal (`BackendSet.down_signal`), so they can move the moment it leaves rotation.
Scraping: ``GET /metrics`` every ``scrape_interval_s`` (`gateway.backends.scrape`): queue depth, KV
usage, block size and KV capacity from ``vllm:cache_config_info``, and
``process_start_time_seconds`` — when it changes, or any of vLLM's counters (prefix-cache
queries, prompt and generation tokens, successful requests) goes backwards, the backend
restarted with an empty cache and the index forgets it (`gateway.backends.index_truth`). The counters
matter where the start time is missing: vLLM serving with several API server processes
exports its metrics in Prometheus' multiprocess mode, which has no ``process_*`` series.
A restart no scrape saw (one with nothing to compare) is caught from usage instead.
Each scrape also closes an interval of the backend's prefill times for its fit, which moves the
spec it is routed on (`dispatch.measured`); a restart resets that to the profile.

Each backend's state is a `gateway.backends.backend_state.BackendState`. The probes' aiohttp
errors are mapped at the upstream seam (`gateway.upstream.errors.mapped_errors`): any failure,
timeout or unreadable page is a failed check or scrape.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import aiohttp

from dispatch import BackendMetrics
from fleet_config.outlier import (
    DEFAULT_HEALTHY_PANIC_THRESHOLD_PERCENT,
    DEFAULT_HEALTHY_THRESHOLD,
    DEFAULT_UNHEALTHY_THRESHOLD,
    OutlierDetectionSection,
)
from gateway.backends.backend_state import BackendState
from gateway.backends.rotation import Rotation
from gateway.backends.scrape import parse_vllm_metrics
from gateway.upstream.errors import Phase, mapped_errors
from gateway.errors import UpstreamError
from gateway.telemetry.metrics import Telemetry

log = logging.getLogger("kappa_gateway.pool")

PROBE_TIMEOUT_S = 2.0
# An extra scrape (`BackendSet.scrape_soon`) at most this often per backend: 5/s, each costing the
# backend a render of its whole exposition page and the gateway a parse (BENCHMARKS.md, "Scraping a backend").
EXTRA_SCRAPE_MIN_GAP_S = 0.2


class BackendSet:
    """Owns the backends' states and the background tasks that keep them fresh.

    Args:
        states: one per configured backend, in config order.
        session: an aiohttp session for probes (the caller owns and closes it).
        telemetry: where backend_up, ejections, panic mode and κ_crit gauges go.
        on_restart: awaited with a backend id when it restarted (the index forgets it).
        health_interval_s, scrape_interval_s: probe periods, s.
        outlier_detection: Envoy's outlier detection settings (`fleet_config.outlier`).
        unhealthy_threshold, healthy_threshold: failed / passed health checks in a row that take
            a backend out of rotation / bring it back.
        healthy_panic_threshold_percent: a model with fewer of its backends in rotation is in panic mode.
        rng: draws for the ``enforcing_*`` percentages.
    """

    def __init__(self, states: list[BackendState], session: aiohttp.ClientSession, telemetry: Telemetry, *,
                 on_restart: Callable[[str], Awaitable[None]], health_interval_s: float,
                 scrape_interval_s: float, outlier_detection: OutlierDetectionSection | None = None,
                 unhealthy_threshold: int = DEFAULT_UNHEALTHY_THRESHOLD,
                 healthy_threshold: int = DEFAULT_HEALTHY_THRESHOLD,
                 healthy_panic_threshold_percent: float = DEFAULT_HEALTHY_PANIC_THRESHOLD_PERCENT,
                 rng: random.Random | None = None) -> None:
        self.states = states
        self.by_id = {s.id: s for s in states}
        # Told of every scrape (previous metrics, new ones): the P/D links' check (gateway.backends.pd_links).
        self.on_scraped: Callable[[BackendState, BackendMetrics, BackendMetrics], None] | None = None
        self._session = session
        self._telemetry = telemetry
        self._on_restart = on_restart
        self._health_interval_s = health_interval_s
        self._scrape_interval_s = scrape_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self._extra_scrapes: set[asyncio.Task[None]] = set()
        self._scrape_due: set[str] = set()  # backends with an extra scrape waiting (one each at most)
        for s in states:
            telemetry.init_backend(s.id, s.spec.kappa_crit_linear, in_flight=lambda s=s: s.ledger.in_flight,
                                   kv_demand_bytes=lambda s=s: s.ledger.kv_demand_bytes)
        self.rotation = Rotation(states, telemetry, outlier_detection or OutlierDetectionSection(),
                                 unhealthy_threshold=unhealthy_threshold, healthy_threshold=healthy_threshold,
                                 healthy_panic_threshold_percent=healthy_panic_threshold_percent, rng=rng)

    def eligible(self, model: str) -> list[BackendState]:
        """The backends a request for ``model`` may go to (`gateway.backends.rotation.Rotation.eligible`)."""
        return self.rotation.eligible(model)

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states)

    def failed(self, state: BackendState, reason: str, *, gateway_failure: bool = True) -> None:
        """A request outcome ``state`` is to blame for: counted toward its ejection
        (`gateway.backends.rotation.Rotation.failed`)."""
        self.rotation.failed(state, reason, gateway_failure=gateway_failure)

    def succeeded(self, state: BackendState) -> None:
        """A complete answer from ``state``: its consecutive-failure counts start again."""
        self.rotation.succeeded(state)

    def down_signal(self, state: BackendState) -> asyncio.Future[str]:
        """A future that resolves (to the reason) when ``state`` next leaves rotation."""
        return self.rotation.down_signal(state)

    async def start(self) -> None:
        """Probe every backend once (so the first requests have candidates), then run the loops."""
        await asyncio.gather(*(self._probe(s) for s in self.states))
        for model in self.rotation.by_model:
            self.rotation.refresh_panic(model)  # a model none of whose backends came up starts in panic
        await asyncio.gather(*(self._scrape(s) for s in self.states if s.healthy))
        self._tasks = [asyncio.create_task(self._loop(self._health_round, self._health_interval_s), name="health"),
                       asyncio.create_task(self._loop(self._scrape, self._scrape_interval_s), name="scrape")]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._extra_scrapes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._extra_scrapes.clear()
        self.rotation.stop()

    def scrape_soon(self, state: BackendState) -> None:
        """Scrape ``state`` off the regular period, as soon as EXTRA_SCRAPE_MIN_GAP_S has passed since
        its last scrape began: the κ_crit fit asks for it when a request ends that its interval
        could not attribute, or a load-bound one, so that the requests finishing after it fall in
        a fresh interval (`dispatch.prefill_feed`). A request inside the gap is deferred to its end,
        not dropped (dropped, it left a load-bound request's interval open until the next regular
        scrape, for others to spoil); one scrape is due per backend at a time, and it is skipped
        when another scrape of the backend began after it was asked for. Does nothing before
        `start` or after `stop`."""
        if not self._tasks or state.id in self._scrape_due:
            return
        self._scrape_due.add(state.id)
        asked_s = asyncio.get_running_loop().time()
        task = asyncio.create_task(self._scrape_after(state, asked_s, state.last_scrape_s + EXTRA_SCRAPE_MIN_GAP_S),
                                   name=f"scrape-{state.id}")
        self._extra_scrapes.add(task)
        task.add_done_callback(self._extra_scrapes.discard)

    async def _scrape_after(self, state: BackendState, asked_s: float, not_before_s: float) -> None:
        """One extra scrape (`scrape_soon`), at ``not_before_s`` (loop time) at the earliest."""
        try:
            delay_s = not_before_s - asyncio.get_running_loop().time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)  # the rate limit's timer
        finally:
            self._scrape_due.discard(state.id)  # from here on a request's end asks for a scrape of its own
        if state.last_scrape_s < asked_s:  # none began since it was asked for
            await self._scrape(state)

    async def _loop(self, probe: Callable[[BackendState], Awaitable[None]], interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(probe(s) for s in self.states))

    async def _health_round(self, state: BackendState) -> None:
        self.rotation.sweep(asyncio.get_running_loop().time())  # at most once per interval_s
        await self._probe(state)

    async def _probe(self, state: BackendState) -> None:
        error: str | None = None
        try:
            with mapped_errors(Phase.PROBE):
                async with self._session.get(f"{state.entry.url}/health",
                                             timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                    if resp.status != 200:
                        error = f"GET /health answered HTTP {resp.status}"
                if error is None and not state.model_checked:
                    error = await self._model_error(state)
        except UpstreamError as exc:  # refused, unreachable, DNS, reset (the seam's message names which)
            error = str(exc)
        except TimeoutError:
            error = f"GET /health did not answer within {PROBE_TIMEOUT_S:g} s"
        self.rotation.checked(state, error is None, asyncio.get_running_loop().time(), error)

    async def _model_error(self, state: BackendState) -> str | None:
        """GET /v1/models once: None if the backend lists the configured model (or has no such
        route, 404: it cannot be checked and is trusted), else why not; a backend that lists other
        models only stays out of rotation. Its aiohttp and timeout errors are the caller's
        (`_probe` maps them and counts them as a failed check)."""
        async with self._session.get(f"{state.entry.url}/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            if resp.status == 404:
                state.model_checked, state.serves_other_model = True, False
                return None
            if resp.status != 200:
                return f"GET /v1/models answered HTTP {resp.status}"
            try:
                listed = {m.get("id") for m in (await resp.json(content_type=None)).get("data", [])}
            except (ValueError, AttributeError, TypeError):
                listed = set()
        if state.entry.model in listed:
            state.model_checked, state.serves_other_model = True, False
            return None
        state.serves_other_model = True
        return f"serves {sorted(str(m) for m in listed) or 'no models'}, not the configured model {state.entry.model!r}"

    async def _scrape(self, state: BackendState) -> None:
        if not state.healthy:
            return
        async with state.scrape_lock:  # scrapes of one backend are applied in the order they were taken
            state.last_scrape_s = asyncio.get_running_loop().time()
            await self._scrape_locked(state)

    async def _scrape_locked(self, state: BackendState) -> None:
        try:
            with mapped_errors(Phase.PROBE):
                async with self._session.get(f"{state.entry.url}/metrics",
                                             timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                    if resp.status != 200:
                        return
                    metrics = parse_vllm_metrics(await resp.text())
        except (UpstreamError, TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", state.id, exc)
            return
        previous = state.metrics
        state.scraped(metrics)
        if self.on_scraped is not None:
            self.on_scraped(state, previous, metrics)
        if _restarted(previous, metrics):
            log.warning("backend %s restarted (process start time or counters reset): forgetting its index entries "
                        "and its measured figures", state.id)
            state.restarted()
            state.model_checked = False
            await self._on_restart(state.id)
        self._measured(state, metrics)

    def _measured(self, state: BackendState, metrics: BackendMetrics) -> None:
        """The scrape closes the backend's fit interval (`dispatch.measured`); a factor newly found beyond
        its profile by more than ``deviation_ratio`` is logged once per backend and factor."""
        observed = state.figures.observed
        if state.measure(metrics, asyncio.get_running_loop().time()):
            log.info("backend %s is routed on measured figures now: %s (time ratios, 1 = its profile)", state.id,
                     ", ".join(f"{k} {v:.3g}" for k, v in state.figures.factors._asdict().items()))
        if state.figures.observed == observed:
            return
        self._telemetry.set_kappa_fit(state.id, state.figures.measurement())
        for factor, ratio in state.figures.new_deviations().items():
            log.warning("backend %s: its %s takes %.3g× the time its profile says (measured from its own prefill "
                        "times; 95%% interval beyond %.3g×): compute κ_crit from measured sustained figures, not the "
                        "datasheet's", state.id, factor, ratio, state.figures.settings.deviation_ratio)


def _restarted(previous: BackendMetrics, current: BackendMetrics) -> bool:
    """A new process start time, or a counter lower than at the previous scrape (the first scrape,
    against all-zero defaults, never is)."""
    start, was = current.process_start_time_s, previous.process_start_time_s
    if start is not None and was is not None and start != was:
        return True
    return any(getattr(current, name) < getattr(previous, name) for name in _RESTART_COUNTERS)


# Counters that only a restart sets back (vLLM's; `BackendMetrics` fields).
_RESTART_COUNTERS = ("prefix_cache_queries_tokens", "prompt_tokens_total", "generation_tokens_total",
                     "requests_succeeded_total")
