"""Kind 4 — one deadline: ``upstream_first_byte_timeout_s`` runs from the gateway's receipt of
the request across every attempt; retries get no fresh budget. With ``timeout`` in
``retry.on`` and ``upstream_per_try_timeout_s``, the attempts share it.

Today (65d19c0) each attempt gets the whole first-byte timeout again, and a first-byte
timeout is retried: two slow backends answer 504 after 2 T, not T.
"""

from __future__ import annotations

import pytest

from tests.integration.gateway_support import backend_doc, poll, run_gateway
from tests.reliability.relay_support import CHAT, assert_openai_error, exchange
from tests.support.misbehaving_upstream import misbehaving_upstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

T = 1.0  # upstream_first_byte_timeout_s
SLOW = {"x-delay-s": "4"}  # first byte after 4 s: far past every deadline here
ROUND_ROBIN = {"policy": "round-robin"}  # the first request tries a, then b, then c


def test_two_slow_backends_get_one_deadline_not_two() -> None:
    with misbehaving_upstream(SLOW) as a, misbehaving_upstream(SLOW) as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"upstream_first_byte_timeout_s": T}) as gw:
        got = exchange(gw.url, CHAT)
        assert_openai_error(got, 504, "timeout_error")
        assert 0.9 * T <= got.elapsed_s < 1.5 * T, f"504 after {got.elapsed_s:.2f} s, deadline {T} s"
        assert len(a.posts) == 1 and b.posts == []  # default retry.on has no "timeout"
        closed_s = poll(lambda: a.posts[0].closed_s, "the upstream to see its connection closed", timeout_s=2)
        assert closed_s - got.started_s < 1.5 * T


def test_a_fast_failure_then_a_slow_retry_share_the_deadline() -> None:
    """a answers 503 after 0.6 s (retried by default); b is slow: 504 at T, not 0.6 s + T."""
    failing = {"x-scenario": "status", "x-status": "503", "x-delay-s": "0.6"}
    with misbehaving_upstream(failing) as a, misbehaving_upstream(SLOW) as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"upstream_first_byte_timeout_s": T}) as gw:
        got = exchange(gw.url, CHAT)
        assert_openai_error(got, 504, "timeout_error")
        assert 0.9 * T <= got.elapsed_s < 1.4 * T, f"504 after {got.elapsed_s:.2f} s, deadline {T} s"
        assert len(a.posts) == len(b.posts) == 1
        assert b.posts[0].body == a.posts[0].body
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1


def test_per_try_timeouts_split_one_deadline_across_three_backends() -> None:
    per_try = 0.4
    with misbehaving_upstream(SLOW) as a, misbehaving_upstream(SLOW) as b, misbehaving_upstream(SLOW) as c, \
            run_gateway([backend_doc(n, u.url) for n, u in (("a", a), ("b", b), ("c", c))], routing=ROUND_ROBIN,
                        gateway={"upstream_first_byte_timeout_s": T, "upstream_per_try_timeout_s": per_try,
                                 "retry": {"retry_on": ["connect-failure", "reset", "5xx", "timeout"], "max_retries": 2}}) as gw:
        got = exchange(gw.url, CHAT)
        assert_openai_error(got, 504, "timeout_error")
        assert 0.9 * T <= got.elapsed_s < 1.4 * T, f"504 after {got.elapsed_s:.2f} s, deadline {T} s"
        assert [len(u.posts) for u in (a, b, c)] == [1, 1, 1]
        closed = [poll(lambda u=u: u.posts[0].closed_s, "the upstreams to see their connections closed",
                       timeout_s=2) - got.started_s for u in (a, b, c)]
        # a and b are cut at their per-try timeouts (0.4 s, 0.8 s); c by what is left of T (0.2 s)
        assert closed == sorted(closed), closed
        assert abs(closed[0] - per_try) < 0.25 and abs(closed[1] - 2 * per_try) < 0.25 and closed[2] < 1.4 * T, closed
        assert sum(gw.metric("gateway_upstream_retries_total", backend=n) for n in "abc") == 2
