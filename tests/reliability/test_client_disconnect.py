"""Kind 6 — a client that disconnects before the first byte (stream or not): the gateway
notices while it waits on the upstream, closes the upstream connection within 1 s, releases
every charge (in-flight back to 0), never retries, and counts ``status="client_disconnect"``.

Today (65d19c0) nobody watches the client until the first upstream byte: the upstream
connection stays open until the first-byte timeout, the request stays in flight, and a
backend that then fails is retried on the next one for a client long gone.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.gateway_support import backend_doc, poll, run_gateway
from tests.reliability.relay_support import CHAT, STREAM, raw_request
from tests.support.misbehaving_upstream import misbehaving_upstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

WAITS = {
    "silent": {"x-scenario": "silent"},  # no status line
    "headers-only": {"x-send-pieces": "0", "x-end": "stall"},  # the head, no body byte
    "slow-then-500": {"x-scenario": "status", "x-delay-s": "1.5"},  # would be retried, were the client there
}


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("wait", list(WAITS))
def test_a_disconnect_before_the_first_byte_closes_the_upstream_and_releases_everything(wait: str,
                                                                                         stream: bool) -> None:
    with misbehaving_upstream(WAITS[wait]) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing={"policy": "round-robin"}) as gw:
        sock = raw_request(gw.url, STREAM if stream else CHAT)
        try:
            poll(lambda: a.posts, "the request to reach a", timeout_s=3)
            assert gw.metric("gateway_in_flight_requests", backend="a") == 1
        finally:
            sock.close()  # the client goes away before any byte of the answer
        gone_s = time.monotonic()
        closed_s = poll(lambda: a.posts[0].closed_s, "the gateway to close a's connection", timeout_s=2)
        assert closed_s - gone_s < 1.0, f"a's connection closed {closed_s - gone_s:.2f} s after the client left"
        poll(lambda: gw.metric("gateway_in_flight_requests", backend="a") == 0, "in-flight back to 0", timeout_s=2)
        assert gw.metric("gateway_kv_demand_bytes", backend="a") == 0
        poll(lambda: gw.metric("gateway_requests_total", status="client_disconnect") == 1,
             "the request to count as client_disconnect", timeout_s=2)
        assert b.posts == [] and gw.metric("gateway_upstream_retries_total") == 0
        assert len(a.posts) == 1


def test_a_client_that_closes_at_done_is_a_complete_stream_not_a_disconnect() -> None:
    """The openai client closes a stream as soon as it reads ``data: [DONE]``; a backend may send its
    end of stream later (here never). Counted ``client_disconnect`` before (and its usage, TTFT and
    the κ_crit feed dropped): 17–19 of 600 such streams at c = 32 in the newcomer trial."""
    with misbehaving_upstream({"x-end": "stall"}) as a, run_gateway([backend_doc("a", a.url)]) as gw:
        sock = raw_request(gw.url, STREAM)
        try:
            got = b""
            while b"data: [DONE]" not in got:
                piece = sock.recv(65536)
                assert piece, f"the stream ended before [DONE]: {got!r}"
                got += piece
        finally:
            sock.close()  # at [DONE], before the backend's end
        poll(lambda: gw.metric("gateway_requests_total", backend="a") == 1, "the request to be counted", timeout_s=3)
        assert gw.metric("gateway_requests_total", status="ok") == 1
        assert gw.metric("gateway_requests_total", status="client_disconnect") == 0
        assert gw.metric("gateway_ttft_seconds_count", backend="a") == 1  # a complete answer's figures
        poll(lambda: gw.metric("gateway_in_flight_requests", backend="a") == 0, "in-flight back to 0", timeout_s=2)
