"""Kind 3 — a hung backend: ``upstream_idle_timeout_s`` bounds the silence once the response
has begun (and, for a stream, the wait for its headers). A stream then ends with the
``timeout_error``/504 event and ``[DONE]``; a body with 504 JSON. The hang counts toward the
backend's outlier ejection (``outlier_detection.consecutive_5xx``): ejected, it stays out for
``base_ejection_time_s`` although its ``/health`` answers. A request waiting on a backend that
fails its health checks moves to another backend, whatever ``retry_on`` says.

Between a stream's headers and its first event the backend prefills: that wait belongs to the
first-byte deadline (and the backend's health), not to the idle timeout.

Today (65d19c0) ``upstream_idle_timeout_s`` exists (default none) but covers only the gaps
between stream chunks, and ends the stream as ``upstream_error``/502; a non-stream body and
stream headers wait forever (or ``upstream_first_byte_timeout_s``); there is no ejection.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.gateway_support import backend_doc, poll, run_gateway
from tests.reliability.relay_support import (
    CHAT,
    STREAM,
    assert_error_tail,
    assert_openai_error,
    exchange,
    get_status,
    split_error_tail,
    upstream_process,
)
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

IDLE = {"upstream_idle_timeout_s": 0.3}
STALL_AFTER_TWO = {"x-send-pieces": "2", "x-end": "stall"}
HEADERS_ONLY = {"x-send-pieces": "0", "x-end": "stall"}


def assert_closed_soon(seen, after_s: float, within_s: float = 1.0) -> None:
    """The gateway closed the upstream connection within ``within_s`` of ``after_s``."""
    closed = poll(lambda: seen.closed_s, "the gateway to close the upstream connection", timeout_s=within_s + 1)
    assert closed - after_s < within_s, f"closed {closed - after_s:.2f} s late"


def test_a_stalled_stream_ends_with_a_timeout_event() -> None:
    with misbehaving_upstream() as up, run_gateway([backend_doc("a", up.url)], gateway=IDLE) as gw:
        got = exchange(gw.url, STREAM, STALL_AFTER_TWO)
        assert got.status == 200 and got.error is None
        assert_error_tail(got.body, b"".join(sse_events()[:2]), "timeout_error", 504)
        assert got.elapsed_s < 2.0
        assert_closed_soon(up.posts[0], got.ended_s)
        poll(lambda: gw.metric("gateway_in_flight_requests", backend="a") == 0, "in-flight back to 0", timeout_s=2)


def test_stream_headers_that_never_come_are_bounded_by_the_idle_timeout() -> None:
    """With the first-byte timeout at its default (600 s), the idle timeout still ends the wait."""
    with misbehaving_upstream({"x-scenario": "silent"}) as up, \
            run_gateway([backend_doc("a", up.url)], gateway=IDLE) as gw:
        got = exchange(gw.url, STREAM, timeout_s=3)
        assert_openai_error(got, 504, "timeout_error")
        assert got.elapsed_s < 1.5
        assert_closed_soon(up.posts[0], got.ended_s)


def test_a_streams_prefill_is_bounded_by_the_deadline_not_the_idle_timeout() -> None:
    """Between a stream's headers and its first event the backend prefills (vLLM sends the
    headers at once): that wait is the first-byte deadline's, so a prefill longer than the idle
    timeout is relayed whole, and a backend silent after its headers is cut at the deadline."""
    slow_prefill = {"x-prefill-s": "0.8"}
    with misbehaving_upstream(slow_prefill) as up, run_gateway([backend_doc("a", up.url)], gateway=IDLE) as gw:
        got = exchange(gw.url, STREAM)
        assert got.status == 200 and got.error is None and got.body == b"".join(sse_events())
        assert got.elapsed_s >= 0.8
        assert gw.metric("gateway_outlier_ejections_total", backend="a") == 0
    with misbehaving_upstream(HEADERS_ONLY) as up, run_gateway(
            [backend_doc("a", up.url)], gateway={**IDLE, "upstream_first_byte_timeout_s": 1.0}) as gw:
        got = exchange(gw.url, STREAM, timeout_s=3)
        assert_openai_error(got, 504, "timeout_error")
        assert 0.9 <= got.elapsed_s < 1.6, got.elapsed_s
        assert_closed_soon(up.posts[0], got.ended_s)


@pytest.mark.parametrize("pieces", ["0", "1"], ids=["headers-only", "half-the-body"])
def test_a_stalled_non_stream_body_is_504(pieces: str) -> None:
    script = {"x-cuts": "40", "x-send-pieces": pieces, "x-end": "stall"}
    with misbehaving_upstream(script) as up, run_gateway([backend_doc("a", up.url)], gateway=IDLE) as gw:
        got = exchange(gw.url, CHAT, timeout_s=3)
        assert_openai_error(got, 504, "timeout_error")
        assert got.elapsed_s < 1.5
        assert_closed_soon(up.posts[0], got.ended_s)
        poll(lambda: gw.metric("gateway_in_flight_requests", backend="a") == 0, "in-flight back to 0", timeout_s=2)
        # counted once (regression: mid-body, the relay's count and the error's both landed)
        assert gw.metric("gateway_requests_total") == 1
        assert gw.metric("gateway_upstream_failures_total", backend="a") == 1


def test_before_non_stream_headers_only_the_first_byte_timeout_counts() -> None:
    """The other edge: the idle timeout starts at the response headers for a non-stream
    request, so a silent backend is cut at the first-byte timeout (1 s), not at 0.3 s."""
    with misbehaving_upstream({"x-scenario": "silent"}) as up, run_gateway(
            [backend_doc("a", up.url)], gateway={**IDLE, "upstream_first_byte_timeout_s": 1.0}) as gw:
        got = exchange(gw.url, CHAT)
        assert_openai_error(got, 504, "timeout_error")
        assert 0.9 <= got.elapsed_s < 1.6, got.elapsed_s


def test_a_hung_backend_is_ejected_for_the_cool_down_although_its_health_answers() -> None:
    ejection_s = 1.0
    with misbehaving_upstream(STALL_AFTER_TWO) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing={"policy": "round-robin"}, gateway=IDLE,
            outlier_detection={"consecutive_5xx": 1, "base_ejection_time_s": ejection_s,
                               "max_ejection_percent": 50}) as gw:
        got = exchange(gw.url, STREAM)
        assert got.headers["x-kappa-backend"] == "a"
        split_error_tail(got.body)
        a.force = {}  # a behaves from now on: only the ejection keeps it out
        poll(lambda: gw.metric("gateway_backend_up", backend="a") == 0, "a to be ejected", timeout_s=1)
        assert gw.metric("gateway_outlier_ejections_total", backend="a") == 1
        for _ in range(3):  # round-robin would have sent one of these to a
            assert exchange(gw.url, CHAT).headers["x-kappa-backend"] == "b"
        assert get_status(a.url, "/health") == 200  # a's health check passes all along
        assert len(a.posts) == 1
        poll(lambda: gw.metric("gateway_backend_up", backend="a") == 1, "a back after the cool-down", timeout_s=4)
        assert time.monotonic() - got.ended_s >= ejection_s - 0.2, "a came back before its cool-down ended"
        backends = {exchange(gw.url, CHAT).headers["x-kappa-backend"] for _ in range(2)}
        assert backends == {"a", "b"}
        assert gw.metric("gateway_outlier_ejections_total", backend="a") == 1


# The default retry_on (no timeout): a move off a backend that left rotation is retried anyway.
FAST_HEALTH = {"health_interval_s": 0.1}


def test_a_frozen_in_thread_backend_fails_its_health_check_and_the_request_moves_on() -> None:
    with misbehaving_upstream() as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing={"policy": "round-robin"},
            gateway=FAST_HEALTH) as gw:
        a.freeze()  # answers nothing, /health included, from now on
        try:
            got = exchange(gw.url, CHAT, timeout_s=8)
        finally:
            a.thaw()
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b"
        assert len(b.posts) == 1
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1
        assert gw.metric("gateway_outlier_ejections_total", backend="a") == 0  # one failure, not five
        poll(lambda: gw.metric("gateway_backend_up", backend="a") == 1, "a back once its checks pass", timeout_s=3)


def test_a_sigstopped_backend_fails_its_health_check_and_the_request_moves_on() -> None:
    with upstream_process() as (proc, a_url), misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a_url), backend_doc("b", b.url)], routing={"policy": "round-robin"},
            gateway=FAST_HEALTH) as gw:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            got = exchange(gw.url, CHAT, timeout_s=8)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b"
        assert len(b.posts) == 1
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1
