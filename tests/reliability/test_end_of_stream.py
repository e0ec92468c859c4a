"""Kind 2 — end of stream: once ``data: [DONE]`` was relayed, a reset or FIN after it adds
nothing (no error event, no second ``[DONE]``); the request counts ``status="ok"`` and keeps
its usage. A failure one event before ``[DONE]`` still gets the error tail.

Today (65d19c0) the relay reads on after ``[DONE]``; aiohttp then raises ClientPayloadError
(the chunked body never terminated) and the gateway appends an error event and a second
``[DONE]``, counting the request as ``upstream_error`` without its usage.
"""

from __future__ import annotations

import pytest

from tests.integration.gateway_support import backend_doc, run_gateway
from tests.reliability.relay_support import STREAM, exchange, split_error_tail
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import USAGE, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

CACHED = USAGE["prompt_tokens_details"]["cached_tokens"]
GAP = "0.05"  # s between writes and before the close: [DONE] is read before the reset arrives


def run(headers: dict[str, str]):
    with misbehaving_upstream() as up, run_gateway([backend_doc("a", up.url)]) as gw:
        got = exchange(gw.url, STREAM, headers)
        counts = {status: gw.metric("gateway_requests_total", backend="a", status=status)
                  for status in ("ok", "upstream_error")}
        return got, up.posts[0], counts, gw.metric("gateway_cached_tokens_reported_total", backend="a")


@pytest.mark.parametrize("end", ["reset", "fin"])
@pytest.mark.parametrize("newline", ["lf", "crlf"])
def test_a_close_after_done_adds_nothing(end: str, newline: str) -> None:
    got, seen, counts, cached = run({"x-newline": newline, "x-end": end, "x-gap-s": GAP})
    assert seen.sent == b"".join(sse_events(newline))
    assert got.body == seen.sent, f"the client got more than the upstream sent: {got.body[len(seen.sent):]!r}"
    assert got.error is None, f"the client's body was not terminated: {got.error}"
    assert counts == {"ok": 1, "upstream_error": 0}
    assert cached == CACHED, "the usage chunk before [DONE] was not kept"


def test_a_reset_after_done_on_a_stream_without_usage() -> None:
    got, seen, counts, cached = run({"x-usage": "0", "x-end": "reset", "x-gap-s": GAP})
    assert got.body == seen.sent == b"".join(sse_events(usage=False)) and got.error is None
    assert counts == {"ok": 1, "upstream_error": 0}
    assert cached == 0


def test_done_and_the_reset_in_one_write() -> None:
    """[DONE] arrives in the same read as the events before it, the reset right after."""
    got, seen, counts, _ = run({"x-cuts": "all", "x-end": "reset", "x-gap-s": GAP})
    assert got.body == seen.sent == b"".join(sse_events()) and got.error is None
    assert counts == {"ok": 1, "upstream_error": 0}


def test_a_reset_one_event_before_done_still_gets_the_error_tail() -> None:
    """The edge on the other side: the stream did not end, so it is an upstream failure."""
    events = sse_events()
    got, seen, counts, _ = run({"x-send-pieces": str(len(events) - 1), "x-end": "reset", "x-gap-s": GAP})
    before, _ = split_error_tail(got.body)
    assert before == seen.sent == b"".join(events[:-1])
    assert got.body.count(b"data: [DONE]") == 1 and got.error is None
    assert counts["ok"] == 0  # today's label for it is "upstream_error"; the spec names none
