"""Kind 8 — shutdown of ``python -m gateway serve`` on SIGTERM: ``/ready`` answers 503 with
``"draining": true`` at once while ``/health`` stays 200 and new requests are still served,
for ``shutdown_drain_delay_s``; then the listener closes (new connections refused); requests
in flight get up to ``graceful_shutdown_timeout_s``; a stream still open then receives the
``service_unavailable_error``/503 event and ``[DONE]`` in a terminated chunked body; exit 0.

Today (65d19c0) SIGTERM closes the listener at once (``/ready`` is refused, not 503), and
uvicorn cancels a stream still open after the graceful timeout: the client's body is cut.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.gateway_support import backend_doc, poll
from tests.reliability.relay_support import (
    CHAT,
    STREAM,
    assert_error_tail,
    exchange,
    gateway_process,
    get_status,
    refused,
)
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import json_body, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class StreamReader(threading.Thread):
    """Reads one stream through the gateway in the background, keeping what came and when."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        super().__init__(daemon=True, name="stream-reader")
        self.url, self.headers = url, headers
        self.got = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.got = exchange(self.url, STREAM, self.headers, timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 -- reported by the test thread
            self.failure = exc


def sigterm(pid: int) -> float:
    os.kill(pid, signal.SIGTERM)  # a process this test started
    return time.monotonic()


def test_sigterm_drains_then_refuses_then_ends_the_open_stream(tmp_path: Path) -> None:
    """Existing keys only: the drain delay is its default (5 s), the grace period 1 s."""
    drain_s, grace_s = 5.0, 1.0
    with misbehaving_upstream() as up, gateway_process(tmp_path, {
            "gateway": {"graceful_shutdown_timeout_s": grace_s, "health_interval_s": 0.2},
            "routing": {"policy": "round-robin"}, "backends": [backend_doc("a", up.url)]}) as gw:
        reader = StreamReader(gw.url, {"x-send-pieces": "1", "x-end": "stall"})  # one event, then silence
        reader.start()
        poll(lambda: up.posts and up.posts[0].sent, "the stream's first event to be sent", timeout_s=5)
        t0 = sigterm(gw.proc.pid)

        def draining() -> httpx.Response | None:
            try:
                resp = httpx.get(gw.url + "/ready", timeout=1.0)
            except httpx.TransportError:
                return None
            return resp if resp.status_code == 503 else None
        ready = poll(draining, "/ready to answer 503", timeout_s=2)
        assert time.monotonic() - t0 < 1.0 and ready.json()["draining"] is True
        assert get_status(gw.url, "/health") == 200
        served = exchange(gw.url, CHAT)  # a new connection, during the drain
        assert served.status == 200 and served.body == json_body()

        refused_s = poll(lambda: refused(gw.url) and time.monotonic(), "the listener to close", timeout_s=drain_s + 3)
        assert refused_s - t0 >= drain_s - 0.3, f"refused {refused_s - t0:.2f} s after SIGTERM, drain {drain_s} s"
        assert reader.is_alive(), "the open stream ended with the drain, before its grace period"

        reader.join(timeout=grace_s + 5)
        assert reader.failure is None, reader.failure
        got = reader.got
        assert got.status == 200 and got.error is None, f"the stream was cut, not ended: {got.error}"
        assert_error_tail(got.body, sse_events()[0], "service_unavailable_error", 503)
        assert got.ended_s - t0 >= drain_s + grace_s - 0.3
        assert gw.proc.wait(timeout=10) == 0, gw.log_text()


def test_a_stream_that_ends_within_the_grace_period_is_relayed_whole(tmp_path: Path) -> None:
    with misbehaving_upstream() as up, gateway_process(tmp_path, {
            "gateway": {"shutdown_drain_delay_s": 0.3, "graceful_shutdown_timeout_s": 5.0, "health_interval_s": 0.2},
            "routing": {"policy": "round-robin"}, "backends": [backend_doc("a", up.url)]}) as gw:
        reader = StreamReader(gw.url, {"x-gap-s": "0.4"})  # five events 0.4 s apart: ~2 s in all
        reader.start()
        poll(lambda: up.posts and up.posts[0].sent, "the stream's first event to be sent", timeout_s=5)
        t0 = sigterm(gw.proc.pid)
        poll(lambda: refused(gw.url), "the listener to close after the drain", timeout_s=3)
        reader.join(timeout=10)
        assert reader.failure is None, reader.failure
        got = reader.got
        assert got.status == 200 and got.error is None
        assert got.body == up.posts[0].sent == b"".join(sse_events())
        assert gw.proc.wait(timeout=5) == 0, gw.log_text()
        assert time.monotonic() - t0 < 5.0, "the process waited out its grace period with nothing in flight"
