"""What the gateway itself adds to a request's latency during a fault, seen by probe clients (issue 16).

The load's own latency is mostly the mock backends' prefill and decode, which vary from
request to request far more than a 2 ms change in what the gateway adds. So `bench/faults.py`
also runs two closed-loop probe clients that send non-streamed chat requests for the model
``probe``, which only an upstream stub serves (`upstream_stub.py`, answering at once),
through the same gateway as the load, on the same event loop:

- **index** probes carry a system prompt of 200 or 800 words (shared prefixes) and a
  fresh question: parse, hashing, the index match on Redis, the decision, the relay and
  the index record;
- **control** probes carry a prompt shorter than one index block, which the gateway
  routes without touching the index (no block hash: no match, no record).

Their latency is the gateway's work plus loopback round trips. It also moves with whatever
else runs on the machine, which hits both kinds alike; so the fault's added latency per
``WINDOW_S`` (250 ms) window, from ``LEAD_S`` before the injection to the window's end, is
the difference in differences

    added_p50 = (p50_index(window) − p50_control(window)) − (p50_index(pre) − p50_control(pre))

with ``pre`` the fault's pre-fault phase: what the index path adds over the gateway's other
work, relative to normal. ``raw_added_p50_ms`` (p50_index(window) − p50_index(pre)) is
reported beside it. ``p50_back_s`` is the time from the injection until the added p50 stays
within ``NORMAL_MARGIN_S`` (2 ms) for the rest of the fault (until SIGCONT or the restart):
the end of the last window above it, 0 if none was, None if the fault's last window still
was. A window where either kind sent nothing (one request took all of it) counts as above
the margin. ``phases`` gives the median of the windows' added p50 over the 2 s before the
injection, the fault's first second, the rest of the fault, the 2 s after the resume and
the rest of the window: these medians ride out the single windows that the machine's noise
now and then puts far off either way (BENCHMARKS.md, "Frozen Redis").

Imports none of the project's packages.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from dataclasses import dataclass

import aiohttp

PROBE_MODEL = "probe"
KINDS = ("index", "control")
# Each kind's client waits this long between requests: ~15-25 of each per 250 ms window here,
# ~100 req/s in all, light next to the load (each costs the gateway well under 1 ms of CPU).
PROBE_THINK_S = 0.005
WINDOW_S = 0.25
LEAD_S = 2.0  # windows shown before the injection
NORMAL_MARGIN_S = 0.002
PROBE_CAP_S = 10.0


@dataclass(frozen=True)
class Sample:
    """One probe request: its kind, seconds since the run started; ok = HTTP 200."""

    kind: str
    sent: float
    latency_s: float
    ok: bool


class Probe:
    """The two closed-loop probe clients (index and control), until `stop`."""

    def __init__(self, url: str, clock, seed: int = 0) -> None:
        self.url, self.clock = url, clock
        self.samples: list[Sample] = []
        self._rnd = random.Random(seed)
        self._prefixes = [" ".join(f"w{self._rnd.randrange(10_000)}" for _ in range(n)) for n in (200, 800)]
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_CAP_S))
        self._tasks = [asyncio.create_task(self._run(kind)) for kind in KINDS]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _body(self, kind: str) -> bytes:
        question = {"role": "user", "content": f"question {self._rnd.randrange(1 << 30)}"}  # < one index block
        messages = [question] if kind == "control" else [
            {"role": "system", "content": self._rnd.choice(self._prefixes)}, question]
        return json.dumps({"model": PROBE_MODEL, "max_tokens": 4, "messages": messages}).encode()

    async def _run(self, kind: str) -> None:
        headers = {"content-type": "application/json"}
        while True:
            body = self._body(kind)
            sent = self.clock()
            ok = False
            try:
                async with self._session.post(self.url, data=body, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                pass
            self.samples.append(Sample(kind, sent, self.clock() - sent, ok))
            await asyncio.sleep(PROBE_THINK_S)  # pacing: the probes must not become the load


def _p50(samples: list[Sample], kind: str, lo: float, hi: float) -> float | None:
    latencies = [s.latency_s for s in samples if s.kind == kind and lo <= s.sent < hi]
    return statistics.median(latencies) if latencies else None


def probe_report(samples: list[Sample], pre_start: float, t0: float, resumed: float | None, end: float) -> dict:
    """The added p50 per window around a fault and the times until it is back to normal.

    Args:
        samples: the probes' requests.
        pre_start, t0, end: the pre-fault phase's start, the injection, the window's end
            (seconds on the bench clock).
        resumed: when the fault was lifted (SIGCONT, restart), None if it never was.

    Returns:
        ``{"normal_p50_ms": {kind: ms}, "windows": [{"t_s", "n", "errors", "added_p50_ms",
        "raw_added_p50_ms"}], "p50_back_s", "max_added_p50_ms_after_back", "phases": {name:
        median added p50 ms}}``; times in seconds from t0, latencies in ms.
    """
    normal = {kind: _p50(samples, kind, pre_start, t0) for kind in KINDS}
    if None in normal.values():
        return {"normal_p50_ms": None, "windows": [], "p50_back_s": None}
    windows = []
    n = math.floor((end - (t0 - LEAD_S)) / WINDOW_S + 1e-9)  # whole windows only
    for i in range(n):
        lo = t0 - LEAD_S + i * WINDOW_S
        p50 = {kind: _p50(samples, kind, lo, lo + WINDOW_S) for kind in KINDS}
        mine = [s for s in samples if lo <= s.sent < lo + WINDOW_S]
        added = raw = None
        if p50["index"] is not None:
            raw = round((p50["index"] - normal["index"]) * 1e3, 2)
            if p50["control"] is not None:
                added = round((p50["index"] - p50["control"] - normal["index"] + normal["control"]) * 1e3, 2)
        windows.append({"t_s": round(lo - t0, 3), "n": {k: sum(s.kind == k for s in mine) for k in KINDS},
                        "errors": sum(not s.ok for s in mine), "added_p50_ms": added, "raw_added_p50_ms": raw})
    stop = end if resumed is None else resumed
    during = [w for w in windows if 0 <= w["t_s"] and w["t_s"] + WINDOW_S <= stop - t0 + 1e-9]
    back_s = back_after(during, 0.0)
    tail = [w["added_p50_ms"] for w in during if back_s is not None and w["t_s"] >= back_s - 1e-9]
    lifted = stop - t0
    spans = {"before": (-LEAD_S, 0.0), "first_1s": (0.0, 1.0), "rest_of_fault": (1.0, lifted),
             "after_resume_2s": (lifted, lifted + 2.0), "later": (lifted + 2.0, end - t0)}
    phases = {}
    for name, (lo, hi) in spans.items():
        values = [w["added_p50_ms"] for w in windows if lo <= w["t_s"] < hi and w["added_p50_ms"] is not None]
        phases[name] = round(statistics.median(values), 2) if values else None
    return {"normal_p50_ms": {k: round(v * 1e3, 2) for k, v in normal.items()}, "windows": windows,
            "p50_back_s": back_s, "max_added_p50_ms_after_back": max(tail) if tail else None, "phases": phases}


def back_after(windows: list[dict], origin_s: float) -> float | None:
    """From ``origin_s``, the end of the last window whose added p50 is over the margin (or is
    unknown: a kind sent nothing in it): 0 if none, None if the last one is (or there are none)."""
    if not windows:
        return None
    bad = [i for i, w in enumerate(windows)
           if w["added_p50_ms"] is None or w["added_p50_ms"] > NORMAL_MARGIN_S * 1e3]
    if not bad:
        return 0.0
    if bad[-1] == len(windows) - 1:
        return None
    return round(windows[bad[-1]]["t_s"] + WINDOW_S - origin_s, 3)
