"""Replay a request trace against any OpenAI-compatible URL, open-loop, and measure it.

``kappa-gateway replay``. Each `sim.traces.TraceRequest` is sent as a
streamed chat completion (`sim.traces.chat_body`) at ``arrival_s / speedup`` seconds after
the start, whatever the server's state (open loop), with at most ``concurrency`` requests in
flight: later arrivals wait for a free slot (**client-side queueing**, reported per request
as ``queue_wait_s``; latencies run from the actual send, so queueing here hides server
overload). Every request ends as a `RequestResult`, failures included: an HTTP status
≥ 400 with the body's message, a connection error or timeout, a mid-stream error event, or
a stream that ends without ``data: [DONE]`` (REFERENCE.md §3).

Timing on the event loop's monotonic clock: TTFT at the first chunk with non-empty content,
ITL as the mean gap between content chunks, E2E at the end of the stream. Usage comes from
the final ``include_usage`` chunk. The gateway's ``x-kappa-*`` headers and ``x-request-id``
are recorded when present (a plain vLLM or the mock sends no ``x-kappa-*``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sim.traces import TraceRequest, chat_body

DEFAULT_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 600.0
"""Per request, send → end of stream: a 126k-token Mooncake prompt plus ~1k output tokens
takes well under a minute on one real GPU; ten times that leaves room for queueing."""
CONNECT_TIMEOUT_S = 10.0
QUEUED_THRESHOLD_S = 0.001
"""A request counts as client-queued when it waited longer than this for a slot, s."""
ERROR_EXAMPLES = 5
KAPPA_HEADERS = ("x-kappa-backend", "x-kappa-prefill-backend", "x-kappa-ratio", "x-kappa-ratio-loaded", "x-kappa-crit", "x-kappa-regime",
                 "x-request-id")


class ReplayError(Exception):
    """The replay could not start (e.g. no model could be discovered at the URL)."""


@dataclass(slots=True)
class RequestResult:
    """The outcome of one replayed request. Times in seconds; token counts from ``usage``."""

    index: int                       # position in the loaded trace
    arrival_s: float                 # trace arrival, s from the trace start (before speedup)
    sent_s: float                    # wall s from the replay start when the request went out
    queue_wait_s: float = 0.0        # client-side queueing: wait for a free slot, s
    status: int | None = None        # HTTP status; None when no response arrived
    error: str | None = None         # None on success
    ttft_s: float | None = None      # send → first non-empty content chunk
    e2e_s: float | None = None       # send → end of the response (or the failure)
    itl_s: float | None = None       # mean gap between content chunks (None with < 2 chunks)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int | None = None
    backend: str | None = None       # x-kappa-backend (a split request's: where it decoded)
    prefill_backend: str | None = None  # x-kappa-prefill-backend: a split request's prefill backend
    kappa_ratio: float | None = None  # x-kappa-ratio: K/T, every cached token
    kappa_ratio_loaded: float | None = None  # x-kappa-ratio-loaded: K_loaded/T (host tier + KV pool)
    kappa_crit: float | None = None  # x-kappa-crit: the request's κ_crit there (inf: never transfer-bound)
    regime: str | None = None        # x-kappa-regime: compute | transfer (ratio-loaded > crit)
    request_id: str | None = None    # x-request-id as echoed

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def api_base(url: str) -> str:
    """``http://host:port`` from a base URL, with or without a trailing ``/v1``.

    Raises:
        ValueError: not an http(s) URL.
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


async def first_model_id(url: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """The first model id ``GET {url}/v1/models`` lists.

    Raises:
        ReplayError: unreachable, an error status, or no model listed.
    """
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"{api_base(url)}/v1/models") as resp:
                if resp.status >= 400:
                    message = _error_message(await resp.text(errors="replace"))
                    raise ReplayError(f"GET /v1/models: HTTP {resp.status}: {message}")
                doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise ReplayError(f"GET {api_base(url)}/v1/models failed: {type(exc).__name__}: {exc}") from exc
    models = doc.get("data") if isinstance(doc, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ReplayError(f"{api_base(url)}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def _error_message(text: str) -> str:
    """The message of an OpenAI/vLLM error body (nested or flat), else the raw text, shortened."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return text[:200]
    if isinstance(doc, dict):
        inner = doc.get("error") if isinstance(doc.get("error"), dict) else doc
        if isinstance(inner.get("message"), str):
            return inner["message"]
    return text[:200]


def _float_header(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _take_usage(result: RequestResult, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    result.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None


def _has_content(choice: Any) -> bool:
    """A chat delta or completion choice with non-empty text."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool((delta.get("content") if isinstance(delta, dict) else None) or choice.get("text"))


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, now: Callable[[], float],
                       sent: float) -> None:
    """Consume an SSE body into ``result`` (TTFT, ITL, usage, errors)."""
    content_times: list[float] = []
    done = False
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:") or done:
                continue
            payload = line[len(b"data:"):].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                result.error = f"malformed SSE chunk: {payload[:80]!r}"
                continue
            if not isinstance(event, dict):
                continue
            if "error" in event:  # a mid-stream error; vLLM still ends with [DONE]
                result.error = f"stream error: {_error_message(json.dumps(event))}"
            if any(_has_content(choice) for choice in event.get("choices") or ()):
                content_times.append(now())
            if event.get("usage"):
                _take_usage(result, event["usage"])
    result.e2e_s = now() - sent
    if content_times:
        result.ttft_s = content_times[0] - sent
        if len(content_times) > 1:
            result.itl_s = (content_times[-1] - content_times[0]) / (len(content_times) - 1)
    if not done and result.error is None:
        result.error = "stream ended without data: [DONE]"


async def _send(session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], request_id: str,
                result: RequestResult, now: Callable[[], float], sent: float, timeout_s: float) -> None:
    """POST one request and fill ``result``; every failure becomes ``result.error``."""
    try:
        async with session.post(endpoint, json=body, headers={"X-Request-Id": request_id}) as resp:
            result.status = resp.status
            got = {name: resp.headers.get(name) for name in KAPPA_HEADERS}
            result.backend, result.regime, result.request_id = (
                got["x-kappa-backend"], got["x-kappa-regime"], got["x-request-id"])
            result.prefill_backend = got["x-kappa-prefill-backend"]
            result.kappa_ratio = _float_header(got["x-kappa-ratio"])
            result.kappa_ratio_loaded = _float_header(got["x-kappa-ratio-loaded"])
            result.kappa_crit = _float_header(got["x-kappa-crit"])
            if resp.status >= 400:
                result.error = f"HTTP {resp.status}: {_error_message(await resp.text(errors='replace'))}"
            elif resp.content_type == "application/json":  # a server that ignored "stream"
                doc = await resp.json()
                _take_usage(result, doc.get("usage") if isinstance(doc, dict) else None)
                result.ttft_s = now() - sent
            else:
                await _read_stream(resp, result, now, sent)
    except TimeoutError as exc:  # before ClientError: aiohttp's timeouts are both
        result.error = f"timeout ({type(exc).__name__}; limits {timeout_s:g} s total, {CONNECT_TIMEOUT_S:g} s connect)"
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if result.e2e_s is None:
        result.e2e_s = now() - sent


def _progress_bar(enabled: bool) -> Progress:
    console = Console(stderr=True)
    return Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[errors]} errors"),
                    TimeElapsedColumn(), console=console, disable=not (enabled and console.is_terminal))


async def replay(
    requests: Sequence[TraceRequest],
    *,
    url: str | Sequence[str],
    model: str,
    speedup: float = 1.0,
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_result: Callable[[RequestResult], None] | None = None,
    progress: bool = True,
) -> list[RequestResult]:
    """Send every request at its (sped-up) arrival time and collect the results.

    Args:
        requests: the trace; sent in arrival order.
        url: the server's base URL (``http://host:port``, an optional ``/v1`` is accepted), or
            several (gateway replicas): request ``i`` goes to ``url[i % len(url)]``, round-robin
            in trace order, as a load balancer in front of them would spread them.
        model: the ``model`` field of every request.
        speedup: trace seconds per wall second, > 0 (10 = ten times faster than recorded).
        concurrency: most requests in flight at once, ≥ 1; also the connection pool size.
        timeout_s: per request, send → end of stream, s.
        on_result: called with each result as it completes (in completion order).
        progress: show a rich progress bar on stderr (only when it is a terminal).

    Returns:
        One `RequestResult` per request, in trace order.

    Raises:
        ValueError: a bad ``url``, ``speedup`` or ``concurrency``.
    """
    if speedup <= 0 or concurrency < 1:
        raise ValueError(f"need speedup > 0 and concurrency ≥ 1, got {speedup}, {concurrency}")
    urls = [url] if isinstance(url, str) else list(url)
    now = asyncio.get_running_loop().time
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    with _progress_bar(progress) as bar:
        run = _Run(requests, model, [f"{api_base(u)}/v1/chat/completions" for u in urls], timeout_s, on_result,
                   now, now(), asyncio.Semaphore(concurrency), bar, bar.add_task("replay", total=len(requests), errors=0))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await run.send_all(session, speedup)
    return [r for r in run.results if r is not None]


class _Run:
    """One replay in flight: where each request goes, the free slots, the results so far."""

    def __init__(self, requests: Sequence[TraceRequest], model: str, endpoints: list[str], timeout_s: float,
                 on_result: Callable[[RequestResult], None] | None, now: Callable[[], float], start: float,
                 slots: asyncio.Semaphore, bar: Progress, task: Any) -> None:
        self.requests, self.model, self.endpoints, self.timeout_s = requests, model, endpoints, timeout_s
        self.on_result, self.now, self.start, self.slots, self.bar, self.task = on_result, now, start, slots, bar, task
        self.run_id = uuid.uuid4().hex[:8]
        self.results: list[RequestResult | None] = [None] * len(requests)
        self.errors = 0

    async def send_all(self, session: aiohttp.ClientSession, speedup: float) -> None:
        """The open loop: each request at its sped-up arrival time, or when a slot frees up."""
        requests, now = self.requests, self.now
        async with asyncio.TaskGroup() as group:
            for index in sorted(range(len(requests)), key=lambda i: requests[i].arrival_s):
                due = self.start + requests[index].arrival_s / speedup
                if due > now():
                    await asyncio.sleep(due - now())  # open loop: wait for the arrival time
                ready = now()
                await self.slots.acquire()  # client-side queueing when all slots are busy
                group.create_task(self.send_one(session, index, now() - ready))

    async def send_one(self, session: aiohttp.ClientSession, index: int, queue_wait_s: float) -> None:
        """Send request ``index`` (holding a slot, released here) and record its result."""
        req, now = self.requests[index], self.now
        try:
            body = chat_body(req, model=self.model, index=index)
            sent = now()
            result = RequestResult(index=index, arrival_s=req.arrival_s, sent_s=sent - self.start,
                                   queue_wait_s=queue_wait_s)
            await _send(session, self.endpoints[index % len(self.endpoints)], body, f"replay-{self.run_id}-{index}",
                        result, now, sent, self.timeout_s)
        finally:
            self.slots.release()
        self.results[index] = result
        self.errors += not result.ok
        self.bar.update(self.task, advance=1, errors=self.errors)
        if self.on_result is not None:
            self.on_result(result)
