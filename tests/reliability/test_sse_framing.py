"""Kind 1 — SSE framing: events end at a blank line in LF, CRLF or CR, split anywhere across
reads, several per read. The client gets exactly the upstream's bytes; usage, TTFT and ITL
are recorded for all three line endings; an incomplete event is never cut by an error tail.

Today (65d19c0) the observer knows only LF (``\\n\\n``): CRLF and CR streams are relayed but
nothing is observed (no TTFT, no usage), and a partial event is relayed before the error tail.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.gateway_support import backend_doc, run_gateway
from tests.reliability.relay_support import (
    STREAM,
    exchange,
    split_error_tail,
)
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import USAGE, event_offsets, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

CACHED = USAGE["prompt_tokens_details"]["cached_tokens"]  # gateway_cached_tokens_reported_total gains this with usage
GAP = "0.02"  # s between the upstream's writes: each write reaches the gateway as its own read


def relay(headers: dict[str, str], body: dict = STREAM):
    """One stream through a gateway with one misbehaving backend "a": (client view, upstream record, gateway)."""
    with misbehaving_upstream() as up, run_gateway([backend_doc("a", up.url)]) as gw:
        got = exchange(gw.url, body, headers)
        observed = {name: gw.metric(name, backend="a") for name in (
            "gateway_ttft_seconds_count", "gateway_itl_seconds_count", "gateway_cached_tokens_reported_total")}
        observed["ok"] = gw.metric("gateway_requests_total", backend="a", status="ok")
        return got, up.posts, observed


def assert_observed(observed: dict, *, itl: bool = True) -> None:
    assert observed["gateway_ttft_seconds_count"] == 1, f"no TTFT recorded: {observed}"
    assert observed["gateway_cached_tokens_reported_total"] == CACHED, f"usage not recorded: {observed}"
    assert observed["ok"] == 1, observed
    if itl:
        assert observed["gateway_itl_seconds_count"] >= 1, f"no ITL recorded: {observed}"


@pytest.mark.parametrize("newline", ["lf", "crlf", "cr"])
def test_each_line_ending_is_relayed_byte_for_byte_and_observed(newline: str) -> None:
    got, posts, observed = relay({"x-newline": newline, "x-gap-s": GAP})
    expected = b"".join(sse_events(newline))
    assert got.status == 200 and got.error is None
    assert got.body == expected == posts[0].sent
    assert posts[0].body == json.dumps(STREAM).encode()  # the request went up byte for byte
    assert_observed(observed)


def test_crlf_split_inside_every_crlf_pair() -> None:
    data = b"".join(sse_events("crlf"))
    cuts = [i + 1 for i in range(len(data)) if data[i:i + 2] == b"\r\n"]  # between each \r and its \n
    got, posts, observed = relay({"x-newline": "crlf", "x-cuts": ",".join(map(str, cuts)), "x-gap-s": GAP})
    assert got.body == data == posts[0].sent and got.error is None
    assert_observed(observed)


def test_cr_events_split_mid_event_and_between_their_two_crs() -> None:
    events = sse_events("cr")
    ends = event_offsets(events) + [len(b"".join(events))]
    cuts = sorted({e - 1 for e in ends} | {e - len(ev) // 2 for e, ev in zip(ends, events)})  # "\r" | "\r", and mid-event
    got, posts, observed = relay({"x-newline": "cr", "x-cuts": ",".join(map(str, cuts)), "x-gap-s": GAP})
    assert got.body == b"".join(events) == posts[0].sent and got.error is None
    assert_observed(observed)


@pytest.mark.parametrize("newline", ["lf", "crlf", "cr"])
def test_a_whole_stream_in_one_read(newline: str) -> None:
    got, posts, observed = relay({"x-newline": newline, "x-cuts": "all"})
    assert got.body == b"".join(sse_events(newline)) == posts[0].sent
    assert_observed(observed, itl=False)  # one read: no gap between content chunks to measure


def test_two_events_per_read_in_crlf() -> None:
    events = sse_events("crlf")
    cuts = event_offsets(events)[1::2]  # after events 2, 4, …
    got, posts, observed = relay({"x-newline": "crlf", "x-cuts": ",".join(map(str, cuts)), "x-gap-s": GAP})
    assert got.body == b"".join(events) == posts[0].sent
    assert_observed(observed)


@pytest.mark.parametrize("newline", ["lf", "crlf", "cr"])
def test_an_incomplete_event_is_not_relayed_before_the_error_tail(newline: str) -> None:
    """The backend resets halfway through its second event: the client gets the first event
    and the error tail, never half an event with an error event glued inside it."""
    events = sse_events(newline)
    first, half = len(events[0]), len(events[0]) + len(events[1]) // 2
    got, posts, _ = relay({"x-newline": newline, "x-cuts": f"{first},{half}", "x-send-pieces": "2",
                           "x-end": "reset", "x-gap-s": GAP})
    assert posts[0].sent == events[0] + events[1][: len(events[1]) // 2]
    assert got.status == 200 and got.error is None, got.error
    before, error = split_error_tail(got.body)
    assert before == events[0], f"relayed before the tail: {before!r}"
    assert error["param"] is None
