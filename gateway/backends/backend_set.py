"""The backend set: health checks, vLLM metrics scraping, restart detection.

Health: ``GET /health`` every ``health_interval_s``; one failure (or a connect error while
proxying) takes a backend out of the candidate set, one success brings it back. Outlier
ejection (Envoy's term): a backend that hung on a request — silent past the idle timeout, or
failing its health check while a request waited on it — stays out for ``outlier_ejection_s``
whatever its health checks say. Requests waiting for a backend's first byte watch its
`BackendSet.down_signal`, so they stop waiting the moment it leaves rotation.
Scraping: ``GET /metrics`` every ``scrape_interval_s`` (`gateway.backends.scrape`): queue depth, KV
usage, block size and KV capacity from ``vllm:cache_config_info``, and
``process_start_time_seconds`` — when it changes, or any of vLLM's counters (prefix-cache
queries, prompt and generation tokens, successful requests) goes backwards, the backend
restarted with an empty cache and the index forgets it (`gateway.backends.index_truth`). The counters
matter where the start time is missing: vLLM serving with several API server processes
exports its metrics in Prometheus' multiprocess mode, which has no ``process_*`` series.
A restart no scrape saw (one with nothing to compare) is caught from usage instead.
Each scrape also closes an interval of the backend's prefill times for its κ_crit fit (`gateway.backends.kappa_feed`).

Each backend's state is a `gateway.backends.backend_state.BackendState`. The probes' aiohttp
errors are mapped at the upstream seam (`gateway.upstream.errors.mapped_errors`): any failure,
timeout or unreadable page is a failed check or scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from dispatch import BackendMetrics
from gateway.backends.backend_state import BackendState
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
        telemetry: where backend_up and κ_crit gauges go.
        on_restart: awaited with a backend id when it restarted (the index forgets it).
        health_interval_s, scrape_interval_s: probe periods, s.
        outlier_ejection_s: how long `eject` keeps a backend out, s.
    """

    def __init__(self, states: list[BackendState], session: aiohttp.ClientSession, telemetry: Telemetry, *,
                 on_restart: Callable[[str], Awaitable[None]], health_interval_s: float,
                 scrape_interval_s: float, outlier_ejection_s: float = 30.0) -> None:
        self._outlier_ejection_s = outlier_ejection_s
        self.states = states
        self.by_id = {s.id: s for s in states}
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

    def eligible(self, model: str) -> list[BackendState]:
        """Healthy backends serving ``model``, in config order."""
        return [s for s in self.states if s.healthy and s.entry.model == model]

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states)

    def mark_down(self, state: BackendState, reason: str) -> None:
        """Out of rotation after a connect failure or reset while proxying; the next passed
        health check brings it back."""
        if state.healthy:
            log.warning("backend %s marked down: %s", state.id, reason)
        self._set_health(state, False, reason, signal_waiters=False)  # their own connections tell them

    def eject(self, state: BackendState, reason: str) -> None:
        """Outlier ejection: out of rotation for ``outlier_ejection_s`` whatever its health checks
        say (it answers /health, but hung on a request)."""
        state.ejected_until_s = asyncio.get_running_loop().time() + self._outlier_ejection_s
        log.warning("backend %s ejected for %gs: %s", state.id, self._outlier_ejection_s, reason)
        self._telemetry.outlier_ejections.labels(state.id).inc()
        self._set_health(state, False, reason)

    def down_signal(self, state: BackendState) -> asyncio.Future[str]:
        """A future that resolves (to the reason) when ``state`` next leaves rotation."""
        signal = state.down_signal
        if signal is None or signal.done():
            signal = state.down_signal = asyncio.get_running_loop().create_future()
        return signal

    async def start(self) -> None:
        """Probe every backend once (so the first requests have candidates), then run the loops."""
        await asyncio.gather(*(self._probe(s) for s in self.states))
        await asyncio.gather(*(self._scrape(s) for s in self.states if s.healthy))
        self._tasks = [asyncio.create_task(self._loop(self._probe, self._health_interval_s), name="health"),
                       asyncio.create_task(self._loop(self._scrape, self._scrape_interval_s), name="scrape")]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._extra_scrapes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._extra_scrapes.clear()

    def scrape_soon(self, state: BackendState) -> None:
        """Scrape ``state`` off the regular period, as soon as EXTRA_SCRAPE_MIN_GAP_S has passed since
        its last scrape began: the κ_crit fit asks for it when a request ends that its interval
        could not attribute, or a load-bound one, so that the requests finishing after it fall in
        a fresh interval (`gateway.backends.kappa_feed`). A request inside the gap is deferred to its end,
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

    async def _probe(self, state: BackendState) -> None:
        try:
            with mapped_errors(Phase.PROBE):
                async with self._session.get(f"{state.entry.url}/health",
                                             timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                    ok = resp.status == 200
                if ok and not state.model_checked:
                    ok = await self._serves_configured_model(state)
        except (UpstreamError, TimeoutError):
            ok = False
        if ok and state.ejected_until_s > asyncio.get_running_loop().time():
            return  # still cooling down after an outlier ejection
        if ok and not state.healthy:
            log.info("backend %s is up", state.id)
        elif not ok and state.healthy:
            log.warning("backend %s failed its health check", state.id)
        self._set_health(state, ok, "it failed its health check")

    async def _serves_configured_model(self, state: BackendState) -> bool:
        """GET /v1/models once: a backend that lists other models only stays out of rotation.

        A backend without the route (404) cannot be checked and is trusted. Its aiohttp and
        timeout errors are the caller's (`_probe` maps them and counts them as a failed check).
        """
        async with self._session.get(f"{state.entry.url}/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            if resp.status == 404:
                state.model_checked = True
                return True
            if resp.status != 200:
                return False
            try:
                listed = {m.get("id") for m in (await resp.json(content_type=None)).get("data", [])}
            except (ValueError, AttributeError, TypeError):
                listed = set()
        if state.entry.model in listed:
            state.model_checked = True
            return True
        log.error("backend %s serves %s, not the configured model %r: kept out of rotation",
                  state.id, sorted(str(m) for m in listed) or "no models", state.entry.model)
        return False

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
        state.metrics = metrics
        interval = state.prefill_feed.scraped(metrics.prefill_time_count, metrics.prefill_time_sum_s)
        if interval is not None and state.kappa_fit.observe(interval):
            self._telemetry.set_kappa_fit(state.id, state.kappa_fit.measurement())
        if _restarted(previous, metrics):
            log.warning("backend %s restarted (process start time or counters reset): forgetting its index entries",
                        state.id)
            state.model_checked = False
            await self._on_restart(state.id)

    def _set_health(self, state: BackendState, healthy: bool, reason: str = "", *, signal_waiters: bool = True) -> None:
        state.healthy = healthy
        self._telemetry.backend_up.labels(state.id).set(1 if healthy else 0)
        if not healthy and signal_waiters and state.down_signal is not None and not state.down_signal.done():
            state.down_signal.set_result(reason)


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
