"""Issue 28 items 1 and 6: ejection that cannot empty the fleet, and what is (not) retried.

Real gateways and real upstreams on 127.0.0.1 (`tests.support.misbehaving_upstream`, whose
``/health`` status a test sets). Envoy's rules (`gateway.backends.outlier`): a health blip
shorter than ``unhealthy_threshold`` checks cuts nothing; consecutive failures eject a
backend for base × times ejected; never more than ``max_ejection_percent`` of a model's
backends ejected; below ``healthy_panic_threshold_percent`` in rotation the model is in
panic mode and its requests go to all its backends; an engine's answer that blames the
request (a prompt over the context length, 400 or 500) is relayed once, as sent.

Today (f91d3ba) one failed ``/health`` takes a backend out and cuts the requests waiting on it
(504), then ejects it for 30 s: a blip on both backends answers 504 and then 503 for 30 s;
there is no ``outlier_detection`` section; a context-length 500 is retried and answers 502.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, run_gateway
from tests.reliability.relay_support import CHAT, STREAM, Received, exchange
from tests.support.misbehaving_upstream import misbehaving_upstream
from tests.support.upstream_wire import sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROUND_ROBIN = {"policy": "round-robin"}
CONTEXT_LENGTH = ("This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
                  "(8990 in the messages, 10 in the completion). Please reduce the length of the messages or completion.")


def in_parallel(n: int, send) -> list[Received]:
    """``n`` requests at once, each in its own thread; their results in order."""
    results: list[Received | None] = [None] * n

    def run(i: int) -> None:
        results[i] = send()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert all(r is not None for r in results), "a request did not finish"
    return results  # type: ignore[return-value]


def test_a_health_blip_on_every_backend_cuts_no_request_and_ejects_nothing() -> None:
    """Both backends fail /health for about one interval while requests wait on them (slow first
    byte): those requests complete, and every request afterwards is answered."""
    interval_s = 0.2
    with misbehaving_upstream({"x-delay-s": "1.0"}) as a, misbehaving_upstream({"x-delay-s": "1.0"}) as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            gateway={"health_interval_s": interval_s}) as gw:
        def blip() -> None:
            poll(lambda: len(a.posts) + len(b.posts) >= 4, "the requests waiting on both backends")
            a.health_status = b.health_status = 503
            # The blip under test: its length is the behaviour (one or two failed checks, fewer than
            # unhealthy_threshold, 3), not a wait for readiness.
            time.sleep(interval_s * 1.5)
            a.health_status = b.health_status = 200

        blipper = threading.Thread(target=blip)
        blipper.start()
        got = in_parallel(4, lambda: exchange(gw.url, CHAT, timeout_s=10))
        blipper.join()
        assert [r.status for r in got] == [200] * 4, [(r.status, r.body[:200]) for r in got]
        assert {r.headers["x-kappa-backend"] for r in got} == {"a", "b"}
        a.force = b.force = {}
        after = [exchange(gw.url, CHAT) for _ in range(4)]
        assert [r.status for r in after] == [200] * 4
        assert gw.metric("gateway_backend_up") == 2
        assert gw.metric("gateway_outlier_ejections_total") == 0
        assert gw.metric("gateway_panic_mode_entries_total") == 0


def _ejected_for_s(gw, backend: str, timeout_s: float) -> float:
    """From now (the backend just ejected) until it is back in rotation, s."""
    start = time.monotonic()
    poll(lambda: gw.metric("gateway_backend_up", backend=backend) == 1, f"{backend} back in rotation",
         timeout_s=timeout_s)
    return time.monotonic() - start


def _fail_until_ejected(gw, backend: str, ejections: int) -> None:
    """Send requests (retried on the healthy backend, so each answers 200) until ``backend``'s
    ``ejections``-th ejection."""
    deadline = time.monotonic() + 10
    while gw.metric("gateway_outlier_ejections_total", backend=backend) < ejections:
        assert time.monotonic() < deadline, f"{backend} was not ejected"
        assert exchange(gw.url, CHAT).status == 200
    assert gw.metric("gateway_backend_up", backend=backend) == 0


def test_a_backend_failing_again_and_again_is_ejected_for_growing_times() -> None:
    base_s = 0.6
    detection = {"consecutive_5xx": 2, "base_ejection_time_s": base_s, "max_ejection_percent": 50,
                 "interval_s": 60}  # no sweep shortens the second ejection
    with misbehaving_upstream({"x-scenario": "status", "x-status": "500"}) as a, misbehaving_upstream() as b, \
            run_gateway([backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
                        outlier_detection=detection) as gw:
        _fail_until_ejected(gw, "a", 1)
        first_s = _ejected_for_s(gw, "a", timeout_s=5)
        _fail_until_ejected(gw, "a", 2)
        view = {x["id"]: x for x in gw.http.get("/v1/kappa/backends").json()["backends"]}["a"]
        assert view["ejected"] and view["times_ejected"] == 2
        assert view["ejection_remaining_s"] > 1.5 * base_s  # 2 × base this time
        second_s = _ejected_for_s(gw, "a", timeout_s=5)
        assert base_s * 0.8 <= first_s < base_s * 1.6, first_s
        assert 2 * base_s * 0.8 <= second_s < 2 * base_s * 1.5, second_s
        assert len(b.posts) >= 4  # every request to a was retried on b


def test_no_more_than_max_ejection_percent_of_a_models_backends_is_ejected() -> None:
    failing = {"x-scenario": "status", "x-status": "503"}
    # Envoy's 10% without always_eject_one_host: of two backends none may go.
    with misbehaving_upstream(failing) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            outlier_detection={"consecutive_5xx": 2, "always_eject_one_host": False}) as gw:
        for _ in range(6):
            assert exchange(gw.url, CHAT).status == 200  # a's 503 retried on b
        assert gw.metric("gateway_outlier_ejections_total") == 0
        assert gw.metric("gateway_outlier_ejections_overflow_total", backend="a") >= 1
        assert gw.metric("gateway_backend_up", backend="a") == 1
    # The defaults (10%, always one): one of two may go, never both, though both fail.
    with misbehaving_upstream(failing) as a, misbehaving_upstream(failing) as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            outlier_detection={"consecutive_5xx": 2}) as gw:
        for _ in range(8):
            assert exchange(gw.url, CHAT).status == 502
            assert gw.metric("gateway_backend_up") >= 1, "both backends ejected"
        assert gw.metric("gateway_outlier_ejections_total") == 1
        assert gw.metric("gateway_outlier_ejections_overflow_total") >= 1


def test_panic_mode_routes_to_every_backend_when_too_few_pass_their_checks() -> None:
    with misbehaving_upstream() as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        a.health_status = b.health_status = 503  # for good: both out of rotation
        poll(lambda: gw.metric("gateway_backend_up") == 0, "both backends out of rotation", timeout_s=3)
        assert gw.metric("gateway_panic_mode", model=MOCK_MODEL) == 1
        got = [exchange(gw.url, CHAT) for _ in range(4)]
        assert [r.status for r in got] == [200] * 4  # not 503: the backends answer requests
        assert {r.headers["x-kappa-backend"] for r in got} == {"a", "b"}
        state = gw.http.get("/v1/kappa/backends").json()
        assert state["panic_mode"] == {MOCK_MODEL: True}
        assert {x["id"]: x["healthy"] for x in state["backends"]} == {"a": False, "b": False}
        b.health_status = 200  # one of two back: 50% is not below the threshold
        poll(lambda: gw.metric("gateway_panic_mode", model=MOCK_MODEL) == 0, "panic mode to end", timeout_s=3)
        assert {exchange(gw.url, CHAT).headers["x-kappa-backend"] for _ in range(3)} == {"b"}
        assert gw.metric("gateway_panic_mode_entries_total", model=MOCK_MODEL) == 1  # counted once per entry


@pytest.mark.parametrize("status", [400, 500])
@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["json", "stream"])
def test_a_prompt_over_the_context_length_is_relayed_once_as_the_engine_sent_it(status: int, body: dict) -> None:
    refusal = {"x-scenario": "status", "x-status": str(status), "x-error-type": "BadRequestError",
               "x-error-message": CONTEXT_LENGTH}
    with misbehaving_upstream(refusal) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN,
            outlier_detection={"consecutive_5xx": 1, "max_ejection_percent": 50}) as gw:
        got = exchange(gw.url, body)
        assert got.status == status
        assert got.body == a.posts[0].sent  # status and body unchanged
        assert got.json()["error"]["message"] == CONTEXT_LENGTH
        assert len(a.posts) == 1 and len(b.posts) == 0  # not retried
        assert gw.metric("gateway_upstream_retries_total") == 0
        assert gw.metric("gateway_upstream_failures_total", backend="a") == 0  # not the backend's failure
        assert gw.metric("gateway_outlier_ejections_total") == 0  # consecutive_5xx is 1: one failure would eject
        assert gw.metric("gateway_backend_up", backend="a") == 1


def test_an_engine_500_that_does_not_blame_the_request_is_still_retried() -> None:
    with misbehaving_upstream({"x-scenario": "status", "x-status": "500"}) as a, misbehaving_upstream() as b, \
            run_gateway([backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        got = exchange(gw.url, STREAM)
        assert got.status == 200 and got.body == b"".join(sse_events())
        assert len(a.posts) == 1 and len(b.posts) == 1


def test_a_stalled_backend_whose_health_check_fails_has_its_waiting_request_moved() -> None:
    """a stalls before its first byte (alive: the connection stays open), then fails its health
    checks: the waiting request moves to b under the default retry_on (no ``timeout``)."""
    with misbehaving_upstream({"x-scenario": "silent"}) as a, misbehaving_upstream() as b, run_gateway(
            [backend_doc("a", a.url), backend_doc("b", b.url)], routing=ROUND_ROBIN) as gw:
        threading.Timer(0.3, lambda: setattr(a, "health_status", 503)).start()
        got = exchange(gw.url, CHAT, timeout_s=8)
        assert got.status == 200 and got.headers["x-kappa-backend"] == "b"
        assert len(a.posts) == 1 and len(b.posts) == 1
        assert 0.3 <= got.elapsed_s < 3.0
        assert gw.metric("gateway_upstream_retries_total", backend="a") == 1
