"""What `bench/index_accuracy.py` watches beside its traffic: the engines' KV events, the gateway's
per-backend index modes, its access log, and the CPU its processes spent.

* `EventCounter`: one ZMQ SUB per backend on the mock's KV-event publisher (the same socket the
  gateway reads, `fleet_config.kv_events`), in a thread: blocks stored and removed per medium (GPU =
  HBM, CPU = the host tier: vLLM's ``OffloadingConnector`` placeholders), ``AllBlocksCleared``, and
  gaps in the sequence numbers (messages this counter missed: its counts are then low bounds).
  Decoded with `prefix_index.engine_events.decode_batch`, both encodings.
* `ModePoller`: ``GET /v1/kappa/backends`` every `MODE_POLL_S`, in a thread: each backend's
  ``kv_events.mode`` (exact | degraded | approximate) over time; `mode_at` gives the mode a backend
  last showed before an instant, which is how a request is attributed a mode (the gateway's choice
  happens between two polls: a mode that changed in between is misattributed, rarely).
* `access_records`: the gateway's JSON access log (``gateway.access_log_format: json``), one line
  per request: the prediction it routed on (``cached_tokens`` = K on the chosen backend: HBM + host
  tier + KV pool, `router.types.Candidate.cached_tokens`) by ``request_id``.
* `cpu_seconds`: user + system CPU of a process (``/proc/<pid>/stat``, Linux), s.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

from fleet_config import Settings
from prefix_index.engine_events import AllBlocksCleared, BlockRemoved, BlockStored, MalformedEvents, decode_batch, decode_seq

MODE_POLL_S = 0.25
POLL_WAIT_MS = 100


class EventCounter:
    """Counts every backend's KV events while running (module docstring); `start`, then `stop`.

    ``counts[backend]`` keys: ``stored_gpu``, ``stored_cpu``, ``removed_gpu``, ``removed_cpu`` (blocks),
    ``cleared`` (AllBlocksCleared events), ``batches``, ``gaps`` (sequence numbers missed), ``malformed``.
    """

    def __init__(self, settings: Settings) -> None:
        self.endpoints = {b.id: (b.kv_events.endpoint, b.kv_events.topic) for b in settings.backends if b.kv_events}
        self.counts: dict[str, Counter[str]] = {b: Counter() for b in self.endpoints}
        self._last_seq: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-counter", daemon=True)
        self._ctx = zmq.Context()
        self._socks: dict[Any, str] = {}

    def start(self) -> None:
        """Connect (before any traffic: a PUB drops what it sends before a subscriber joins)."""
        for backend, (endpoint, topic) in self.endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.linger = 0
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(endpoint)
            self._socks[sock] = backend
        self._thread.start()

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop, close the sockets; the counts per backend."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sock in self._socks:
            sock.close()
        self._ctx.term()
        return {b: dict(c) for b, c in self.counts.items()}

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_WAIT_MS):
                self._take(self._socks[sock], sock.recv_multipart())

    def _take(self, backend: str, frames: list[bytes]) -> None:
        counts = self.counts[backend]
        if len(frames) != 3:
            counts["malformed"] += 1
            return
        seq = decode_seq(frames[1])
        last = self._last_seq.get(backend)
        if last is not None and seq > last + 1:
            counts["gaps"] += seq - last - 1
        self._last_seq[backend] = seq
        try:
            batch = decode_batch(frames[2])
        except MalformedEvents:
            counts["malformed"] += 1
            return
        counts["batches"] += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts[f"stored_{(event.medium or 'GPU').lower()}"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counts[f"removed_{(event.medium or 'GPU').lower()}"] += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                counts["cleared"] += 1


class ModePoller:
    """Polls the gateway's per-backend KV-event modes (module docstring); `start`, then `stop`."""

    def __init__(self, gateway_url: str) -> None:
        self.url = f"{gateway_url}/v1/kappa/backends"
        self.times_s: list[float] = []  # time.monotonic() of each successful poll
        self.modes: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mode-poller", daemon=True)

    def start(self) -> None:
        """Poll once now (so every request has a mode to be attributed), then every `MODE_POLL_S`."""
        self._poll()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(MODE_POLL_S):
            self._poll()

    def _poll(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=2.0) as resp:
                backends = json.load(resp)["backends"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return
        self.times_s.append(time.monotonic())
        self.modes.append({b["id"]: (b.get("kv_events") or {}).get("mode", "approximate") for b in backends})

    def mode_at(self, backend: str, at_s: float) -> str | None:
        """The mode ``backend`` showed at the last poll before ``at_s`` (time.monotonic()); None before any."""
        i = bisect.bisect_right(self.times_s, at_s) - 1
        return self.modes[i].get(backend) if i >= 0 else None

    def time_shares(self) -> dict[str, dict[str, float]]:
        """Per backend, the share of polls it showed each mode in."""
        out: dict[str, Counter[str]] = {}
        for snapshot in self.modes:
            for backend, mode in snapshot.items():
                out.setdefault(backend, Counter())[mode] += 1
        return {b: {m: n / sum(c.values()) for m, n in c.items()} for b, c in out.items()}


def access_records(log_path: Path) -> dict[str, dict[str, Any]]:
    """``request_id`` -> its access-log record, from a gateway's stderr with JSON access lines
    (other log lines are skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "request_id" in record and "route" in record:
            out[str(record["request_id"])] = record
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None once it is gone or off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
