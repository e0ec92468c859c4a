"""Kind 5 — retries: by default a connect failure, a reset and a 5xx before the first byte
are retried once on the next backend; a first-byte timeout is not (unless ``timeout`` is in
``retry.on``); ``retry.max_retries`` sets the extra attempts (0: none); a body over
``retry.max_body_bytes`` is never re-sent; ``gateway_upstream_retries_total`` counts retries.

Today (65d19c0) the defaults hold except that a first-byte timeout is retried too, and
there is no ``retry`` section (one retry, always, whatever the body size).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.gateway_support import backend_doc, run_gateway
from tests.reliability.relay_support import CHAT, STREAM, assert_openai_error, exchange
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import json_body, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

ROUND_ROBIN = {"policy": "round-robin"}  # the first request tries a, then b, then c
FAILURES = {
    "500": {"x-scenario": "status", "x-status": "500"},
    "503": {"x-scenario": "status", "x-status": "503"},
    "reset": {"x-scenario": "reset"},
    "fin": {"x-scenario": "close"},
    "headers-then-reset": {"x-send-pieces": "0", "x-end": "reset"},
}


def retry_section(**kw: object) -> dict:
    return {"retry": {"retry_on": ["connect-failure", "reset", "5xx"], **kw}}


def assert_5xx_not_retried(got, a, b) -> None:
    """a's 5xx reached the client — as the gateway's 502, or as a's own answer (the spec does
    not say which) — and b saw nothing."""
    assert got.status in (500, 502) and "error" in got.json(), (got.status, got.body[:200])
    assert len(a.posts) == 1 and b.posts == []


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_default_retry_before_the_first_byte(failure: str, stream: bool) -> None:
    body = STREAM if stream else CHAT
    with misbehaving_upstream(FAILURES[failure]) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        got = exchange(gw.url, body)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b"
        assert got.body == b.posts[0].sent == (b"".join(sse_events()) if stream else json_body())
        assert a.posts[0].body == b.posts[0].body == json.dumps(body).encode()
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1


def test_a_connect_failure_is_retried() -> None:
    with misbehaving_upstream() as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"health_interval_s": 60}) as gw:  # the pool does not notice a go
        a.stop()
        got = exchange(gw.url, CHAT)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b" and len(b.posts) == 1
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1


def test_a_first_byte_timeout_is_not_retried_by_default() -> None:
    with misbehaving_upstream({"x-delay-s": "4"}) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"upstream_first_byte_timeout_s": 0.5}) as gw:
        got = exchange(gw.url, CHAT)
        assert_openai_error(got, 504, "timeout_error")
        assert b.posts == [], "a first-byte timeout was retried"
        assert gw.metric("gateway_upstream_retries_total") == 0


def test_a_per_try_timeout_is_retried_when_timeout_is_in_retry_on() -> None:
    with misbehaving_upstream({"x-delay-s": "4"}) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"upstream_per_try_timeout_s": 0.3,
                     "retry": {"retry_on": ["connect-failure", "reset", "5xx", "timeout"]}}) as gw:
        got = exchange(gw.url, CHAT)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b" and got.body == json_body()
        assert got.elapsed_s < 1.0
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1


def test_max_retries_zero_disables_retries() -> None:
    with misbehaving_upstream(FAILURES["500"]) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway=retry_section(max_retries=0)) as gw:
        got = exchange(gw.url, CHAT)
        assert_5xx_not_retried(got, a, b)
        assert gw.metric("gateway_upstream_retries_total") == 0


def test_max_retries_two_reaches_the_third_backend() -> None:
    with misbehaving_upstream(FAILURES["503"]) as a, misbehaving_upstream(FAILURES["reset"]) as b, \
            misbehaving_upstream() as c, run_gateway(
                [backend_doc(n, u.url) for n, u in (("a", a), ("b", b), ("c", c))], routing=ROUND_ROBIN,
                gateway=retry_section(max_retries=2)) as gw:
        got = exchange(gw.url, CHAT)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "c" and got.body == json_body()
        assert a.posts[0].body == b.posts[0].body == c.posts[0].body
        assert [gw.metric("gateway_upstream_retries_total", backend=n) for n in "abc"] == [1, 1, 0]


def test_5xx_left_out_of_retry_on_is_not_retried() -> None:
    with misbehaving_upstream(FAILURES["500"]) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"retry": {"retry_on": ["connect-failure", "reset"]}}) as gw:
        got = exchange(gw.url, CHAT)
        assert_5xx_not_retried(got, a, b)
        assert gw.metric("gateway_upstream_retries_total") == 0


def body_of_size(size: int) -> bytes:
    """A chat request body of exactly ``size`` bytes."""
    empty = json.dumps({**CHAT, "messages": [{"role": "user", "content": ""}]}).encode()
    return json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (size - len(empty))}]}).encode()


@pytest.mark.parametrize(("size", "resent"), [(2048, True), (2049, False)], ids=["at-the-limit", "over-the-limit"])
def test_a_body_over_retry_max_body_bytes_is_never_resent(size: int, resent: bool) -> None:
    body = body_of_size(size)
    assert len(body) == size
    with misbehaving_upstream(FAILURES["500"]) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway=retry_section(max_body_bytes=2048)) as gw:
        got = exchange(gw.url, body)
        assert a.posts[0].body == body
        if resent:
            assert got.status == 200 and b.posts[0].body == body
        else:
            assert_5xx_not_retried(got, a, b)
        assert gw.metric("gateway_upstream_retries_total", backend="a") == (1 if resent else 0)
