"""Kinds 7 and 9 — what the gateway sends upstream besides the body.

7. Each upstream attempt carries its own ``X-Request-Id``: the client's id (or a generated
   one) plus a unique suffix, ``<id>-<hex>``; the client gets its own id back.
9. ``Expect`` is never forwarded (the gateway holds the body already); headers named in the
   client's ``Connection`` header are dropped with the RFC 9110 hop-by-hop set;
   ``X-Forwarded-For`` gets the client's address appended.

Today (65d19c0) every attempt carries the same id; ``Expect: 100-continue`` goes upstream,
where aiohttp then waits for a ``100 Continue`` before sending the body (an upstream that
never sends one hangs the request); ``Connection``-named headers pass; XFF is untouched.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.gateway_support import backend_doc, run_gateway
from tests.reliability.relay_support import CHAT, STREAM, assert_openai_error, exchange
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import json_body, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

ROUND_ROBIN = {"policy": "round-robin"}
FAIL_500 = {"x-scenario": "status", "x-status": "500"}
HEX_SUFFIX = "-[0-9a-f]+"


def attempt_ids(*upstreams) -> list[str]:
    return [p.headers["x-request-id"] for u in upstreams for p in u.posts]


@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["body", "stream"])
def test_each_attempt_carries_its_own_id_built_from_the_clients(body: dict) -> None:
    with misbehaving_upstream(FAIL_500) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        got = exchange(gw.url, body, {"x-request-id": "req-7f"})
        assert got.status == 200 and got.headers["x-request-id"] == "req-7f"
        ids = attempt_ids(a, b)
        assert len(ids) == 2 and len(set(ids)) == 2, f"attempts share an id: {ids}"
        assert all(re.fullmatch("req-7f" + HEX_SUFFIX, i) for i in ids), ids


def test_a_generated_id_is_the_prefix_of_every_attempts_id() -> None:
    with misbehaving_upstream(FAIL_500) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        got = exchange(gw.url, CHAT)
        own = got.headers["x-request-id"]
        ids = attempt_ids(a, b)
        assert own and len(set(ids)) == 2 and all(re.fullmatch(re.escape(own) + HEX_SUFFIX, i) for i in ids), (own, ids)


def test_the_gateways_own_error_echoes_the_clients_id_after_two_attempts() -> None:
    with misbehaving_upstream(FAIL_500) as a, misbehaving_upstream({**FAIL_500, "x-status": "503"}) as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        got = exchange(gw.url, CHAT, {"x-request-id": "req-err"})
        assert_openai_error(got, 502, "upstream_error")
        assert got.headers["x-request-id"] == "req-err"
        ids = attempt_ids(a, b)
        assert len(set(ids)) == 2 and all(re.fullmatch("req-err" + HEX_SUFFIX, i) for i in ids), ids


def test_expect_100_continue_is_not_forwarded() -> None:
    """The upstream never sends ``100 Continue``: it reads a body when one arrives."""
    with misbehaving_upstream() as a, run_gateway([backend_doc("a", a.url)],
                                                  gateway={"upstream_first_byte_timeout_s": 2.0}) as gw:
        got = exchange(gw.url, CHAT, {"expect": "100-continue"})
        assert got.status == 200 and got.body == json_body(), (got.status, got.body[:200])
        assert "expect" not in a.posts[0].headers
        assert a.posts[0].body == json.dumps(CHAT).encode()
        assert got.elapsed_s < 1.0


def test_headers_named_in_connection_are_dropped() -> None:
    with misbehaving_upstream() as a, run_gateway([backend_doc("a", a.url)]) as gw:
        got = exchange(gw.url, STREAM, {"connection": "keep-alive, x-hop-secret, X-Other-Hop", "x-hop-secret": "s3",
                                        "x-other-hop": "1", "keep-alive": "timeout=5", "te": "trailers",
                                        "x-kept": "yes", "authorization": "Bearer sk-test"})
        assert got.status == 200 and got.body == b"".join(sse_events())
        seen = a.posts[0].headers
        for dropped in ("x-hop-secret", "x-other-hop", "keep-alive", "te", "expect"):
            assert dropped not in seen, f"{dropped} was forwarded: {seen}"
        assert seen.get("connection", "keep-alive").lower() in ("keep-alive", "close"), seen
        assert seen["x-kept"] == "yes" and seen["authorization"] == "Bearer sk-test"


@pytest.mark.parametrize(("sent", "forwarded"), [
    (None, "127.0.0.1"),
    ("203.0.113.7", "203.0.113.7, 127.0.0.1"),
    ("203.0.113.7, 198.51.100.2", "203.0.113.7, 198.51.100.2, 127.0.0.1"),
], ids=["none", "one-hop", "two-hops"])
def test_x_forwarded_for_gets_the_clients_address_appended(sent: str | None, forwarded: str) -> None:
    with misbehaving_upstream() as a, run_gateway([backend_doc("a", a.url)]) as gw:
        got = exchange(gw.url, CHAT, {"x-forwarded-for": sent} if sent else {})
        assert got.status == 200
        assert a.posts[0].headers.get("x-forwarded-for") == forwarded
