"""The load of `bench/faults.py`, how each answer is classified, and each fault's window.

Imports none of the project's packages.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from faults_upgrade import FLOOD_NOTES

CLASSES = ("ok", "clear_error", "truncated", "hung")
# A 1-s bin counts as recovered throughput at this share of the pre-fault ok completions per second.
RECOVERY_RATE_SHARE = 0.8
RECOVERY_BIN_S = 1.0

WORDS = 4096
PREFIX_TOKENS = (300, 1000, 2000, 4000)  # shared system prompts (~4 bytes of text per token)
SUFFIX_TOKENS = (20, 200)
MAX_TOKENS = (32, 128)


class Bodies:
    """Chat bodies: one of four shared system prompts (a few hundred to a few thousand tokens)
    plus a fresh user turn, max_tokens drawn from MAX_TOKENS; streams ask for usage."""

    def __init__(self, model: str, seed: int) -> None:
        rnd = random.Random(seed)
        self.model = model
        self.vocab = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 7))) for _ in range(WORDS)]
        self.prefixes = [self._text(rnd, n) for n in PREFIX_TOKENS]

    def _text(self, rnd: random.Random, tokens: int) -> str:
        return " ".join(rnd.choices(self.vocab, k=max(tokens * 4 * 2 // 11, 1)))  # 4.5 letters + a space a word

    def make(self, rnd: random.Random, stream: bool) -> bytes:
        body: dict = {"model": self.model, "stream": stream, "max_tokens": rnd.randint(*MAX_TOKENS), "messages": [
            {"role": "system", "content": rnd.choice(self.prefixes)},
            {"role": "user", "content": self._text(rnd, rnd.randint(*SUFFIX_TOKENS))}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class Record:
    """One request: times are seconds since the run started (the bench's monotonic clock)."""

    stream: bool
    sent: float
    done: float
    cls: str
    status: int | None = None
    detail: str = ""  # the client-side exception, if any ("refused" for a refused connection)
    backend: str | None = None  # x-kappa-backend
    prefill_backend: str | None = None  # x-kappa-prefill-backend: a split request's (P/D)
    unclean_end: bool = False  # complete SSE content, but the HTTP body was cut, not terminated


def sse_payloads(body: bytes) -> list[bytes]:
    """The data payloads of an SSE body, event by event (CRLF, CR or LF line ends)."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    payloads = []
    for event in text.split(b"\n\n"):
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            payloads.append(b"\n".join(data))
    return payloads


def _error_json(payload: bytes) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


def classify(stream: bool, status: int | None, body: bytes) -> str:
    """ok, clear_error or truncated (see the faults.py docstring); hung is decided by the caller."""
    if status is None:
        return "truncated"  # no response at all: refused, reset, closed
    if status >= 400:
        return "clear_error" if _error_json(body) else "truncated"
    if status != 200:
        return "truncated"
    if not stream:
        try:
            obj = json.loads(body)
        except ValueError:
            return "truncated"
        return "ok" if isinstance(obj, dict) and isinstance(obj.get("choices"), list) else "truncated"
    payloads = sse_payloads(body)
    done = bool(payloads) and payloads[-1] == b"[DONE]"
    errors = [i for i, p in enumerate(payloads) if p != b"[DONE]" and _error_json(p)]
    if not errors:
        return "ok" if done else "truncated"
    return "clear_error" if done or errors[-1] == len(payloads) - 1 else "truncated"


class Load:
    """Closed-loop workers (half streamed) sending through the gateway until `stop`.

    Each worker sends one request, reads it whole, waits ``think_s`` and goes again. A request
    still unfinished after ``cap_s`` is abandoned and recorded as hung. While the gate is
    closed (`close_gate`) no new request starts, as a load balancer stops sending to a
    replica that is not ready.
    """

    def __init__(self, url: str, bodies: Bodies, workers: int, think_s: float, cap_s: float, clock, seed: int) -> None:
        self.url, self.bodies, self.workers, self.think_s, self.cap_s = url, bodies, workers, think_s, cap_s
        self.clock, self.seed = clock, seed
        self.records: list[Record] = []
        self._open = asyncio.Event()
        self._open.set()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._n = 0
        self.in_flight = 0
        self.streams: dict[int, str | None] = {}  # streams in flight: request number -> backend once known

    def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    def close_gate(self) -> None:
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    async def drained(self) -> None:
        """Until no request is in flight (each is bounded by cap_s)."""
        while self.in_flight:
            await asyncio.sleep(0.01)  # polling the bench's own bookkeeping

    async def wait_stream(self, backend: str | None, timeout_s: float = 3.0) -> int:
        """Until a stream is in flight (on ``backend``, from its response headers, if given); their count.
        Returns 0 if none came within ``timeout_s`` (the caller injects its fault anyway)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            n = sum(1 for b in self.streams.values() if backend is None or b == backend)
            if n:
                return n
            await asyncio.sleep(0.002)  # polling the bench's own bookkeeping
        return 0

    async def stop(self, abort: bool = False) -> None:
        """No new requests; wait for those in flight (each bounded by cap_s), or cancel them if ``abort``."""
        self._stopping = True
        self._open.set()
        if abort:
            for task in self._tasks:
                task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=abort)
        finally:
            if self._session is not None:
                await self._session.close()

    async def _worker(self, i: int) -> None:
        rnd = random.Random(self.seed * 1000 + i)
        stream = i % 2 == 0
        while True:
            await self._open.wait()
            if self._stopping:
                return
            self.records.append(await self._one(self.bodies.make(rnd, stream), stream))
            await asyncio.sleep(self.think_s)  # pacing, to keep this shared 2-core machine's load moderate

    async def _one(self, body: bytes, stream: bool) -> Record:
        self._n += 1
        n = self._n
        headers = {"content-type": "application/json", "x-request-id": f"faults-{n}"}
        sent = self.clock()
        status, backend, prefill, buf, detail = None, None, None, bytearray(), ""
        if stream:
            self.streams[n] = None
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.cap_s):
                async with self._session.post(self.url, data=body, headers=headers) as resp:
                    status, backend = resp.status, resp.headers.get("x-kappa-backend")
                    prefill = resp.headers.get("x-kappa-prefill-backend")
                    if stream:
                        self.streams[n] = backend
                    async for chunk in resp.content.iter_any():
                        buf += chunk
        except TimeoutError:
            return Record(stream, sent, self.clock(), "hung", status, "client cap", backend, prefill)
        except aiohttp.ClientConnectorError:
            detail = "refused"
        except aiohttp.ClientError as exc:
            detail = type(exc).__name__
        finally:
            self.streams.pop(n, None)
            self.in_flight -= 1
        cls = classify(stream, status, bytes(buf))
        unclean = bool(detail) and status is not None and cls != "truncated"
        return Record(stream, sent, self.clock(), cls, status, detail, backend, prefill, unclean)


@dataclass
class Window:
    """One fault: load runs over [pre_start, t0) untouched, the fault is injected at t0, the
    window closes at ``end``. ``notes`` are the fault's own facts (victim, resumed_s, ...)."""

    name: str
    pre_start: float
    t0: float
    end: float
    recovery: bool = True  # False when the fault ends the gateway (nothing to recover to)
    notes: dict = field(default_factory=dict)


def busiest_backend(records: list[Record], since: float) -> str | None:
    """The backend that answered most requests completed since ``since``."""
    counts = Counter(r.backend for r in records if r.done >= since and r.backend)
    return counts.most_common(1)[0][0] if counts else None


def summarize(records: list[Record], w: Window) -> dict:
    """Counts of the window's requests by class, recovery_s, and the pre-fault rate."""
    mine = [r for r in records if r.sent < w.end and r.done > w.t0]
    out: dict = {"sent": len(mine), **{c: sum(r.cls == c for r in mine) for c in CLASSES}}
    out["streamed"] = {"sent": sum(r.stream for r in mine), **{c: sum(r.stream and r.cls == c for r in mine)
                                                                for c in CLASSES}}
    pre_s = w.t0 - w.pre_start
    pre_ok = [r for r in records if r.cls == "ok" and w.pre_start <= r.done < w.t0]
    rate = len(pre_ok) / pre_s if pre_s > 0 else 0.0
    out["recovery_s"] = recovery_s(records, w, rate) if w.recovery else None
    out["pre_ok_per_s"] = round(rate, 2)
    out["in_flight_at_t0"] = sum(r.sent <= w.t0 < r.done for r in records)
    out["streams_in_flight_at_t0"] = sum(r.stream and r.sent <= w.t0 < r.done for r in records)
    out["refused"] = sum(r.detail == "refused" for r in mine)
    out["unclean_end"] = sum(r.unclean_end for r in mine)
    failed = [r for r in mine if r.cls != "ok"]
    out["first_failure_s"] = round(min(r.sent for r in failed) - w.t0, 3) if failed else None
    out["last_failure_s"] = round(max(r.sent for r in failed) - w.t0, 3) if failed else None
    latency = [r.done - r.sent for r in mine if r.cls == "ok"]
    out["ok_latency_p50_s"] = round(statistics.median(latency), 4) if latency else None
    out["ok_latency_max_s"] = round(max(latency), 3) if latency else None
    out["window_s"] = round(w.end - w.t0, 2)
    out["ok_per_bin"] = [oks for _, _, oks in ok_per_bin(records, w)]  # ok completions in each 1-s bin from t0
    return out


def recovery_s(records: list[Record], w: Window, pre_ok_per_s: float) -> float | None:
    """End of the last bad 1-s bin after t0, in seconds from t0 (0 if none); None if the last bin is bad.

    A bin [t0 + i, t0 + i + 1) is bad if a request sent in it did not end ok, or if fewer
    requests completed ok in it than RECOVERY_RATE_SHARE x the pre-fault ok rate.
    """
    last_bad = -1
    bins = ok_per_bin(records, w)
    for i, (lo, hi, oks) in enumerate(bins):
        failed = any(lo <= r.sent < hi and r.cls != "ok" for r in records)
        if failed or oks < RECOVERY_RATE_SHARE * pre_ok_per_s * (hi - lo):
            last_bad = i
    if last_bad == len(bins) - 1:
        return None
    return round((last_bad + 1) * RECOVERY_BIN_S, 1)


def ok_per_bin(records: list[Record], w: Window) -> list[tuple[float, float, int]]:
    """(start, end, ok completions) of each 1-s bin from t0 to the window's end (the last bin
    takes the remainder, so it lasts 1 to 2 s; a window under 1 s is one bin)."""
    n = max(math.floor((w.end - w.t0) / RECOVERY_BIN_S + 1e-9), 1)
    out = []
    for i in range(n):
        lo = w.t0 + i * RECOVERY_BIN_S
        hi = w.end if i == n - 1 else lo + RECOVERY_BIN_S
        out.append((lo, hi, sum(lo <= r.done < hi and r.cls == "ok" for r in records)))
    return out


NOTE_KEYS = ("victim", "resumed_s", "restarted_s", "p50_back_s", "ok_latency_max_s", "exit_code", "exit_s",
             "load_stopped_s", *FLOOD_NOTES, "split_share", "splits", "prefill_fallbacks",
             "disconnected_in_prefill", "running_zero_s", "held_after_abort_timeout")


def table(report: dict) -> str:
    """A Markdown table: the classes, recovery and counters per fault, and its notes."""
    cols = ("sent", *CLASSES, "recovery_s", "refused", "index_errors", "retries")
    lines = ["| fault | " + " | ".join(cols) + " | notes |", "|---" * (len(cols) + 2) + "|"]
    for name, row in report["faults"].items():
        notes = {k: v for k, v in row.items() if k in NOTE_KEYS}
        cells = ["–" if row[c] is None else f"{row[c]:g}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {json.dumps(notes)} |")
    return "\n".join(lines)
