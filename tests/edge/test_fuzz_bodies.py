"""No body gets a 5xx from the gateway, a non-OpenAI error, or a dropped connection (issue 16).

A real gateway (``kappa-gateway serve``, memory index) in front of two real mock vLLM
backends (``kappa-gateway mock-fleet``), each its own process on 127.0.0.1
(`tests.edge.processes` says why not threads); hypothesis draws request bodies
(`tests.support.fuzz_bodies`: mutated OpenAI bodies, deep nesting, random JSON, random
bytes) and each of the three POST routes gets
`EXAMPLES_PER_ROUTE` of them over ONE keep-alive connection (`tests.support.keepalive`:
never silently reopened). Every answer must be:

- not a 5xx of the gateway's own (a relayed answer carries ``x-kappa-backend``; none of the
  mocks' answers is a 5xx either, but one relayed would be labelled and allowed);
- if an error, OpenAI-shaped: ``{"error": {"message": str, "type": str, "code": <status>}}``;
- on a proxy route, a 200 relayed from a backend; on ``/v1/kappa/route``, a 200 naming the
  chosen backend.

and the connection must never be reset or closed, and must serve a valid request at the
end. Deterministic (``derandomize``, no example database); ~2,100 bodies in all.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from prometheus_client.parser import text_string_to_metric_families

from tests.edge.processes import gateway_process
from tests.integration.gateway_support import MOCK_MODEL
from tests.support.fuzz_bodies import ROUTES, request_bodies
from tests.support.keepalive import Answer, ConnectionLost, OneConnection, is_openai_error

pytestmark = pytest.mark.integration

EXAMPLES_PER_ROUTE = 700  # 3 routes: 2,100 bodies, ≥ 2,000 (issue 16)
FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate, Phase.shrink))
VALID = {
    "/v1/chat/completions": {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 2},
    "/v1/completions": {"model": MOCK_MODEL, "prompt": "ok?", "max_tokens": 2},
    "/v1/kappa/route": {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "ok?"}]},
}


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_process(Path(tmp_path_factory.mktemp("fuzz"))) as url:
        yield url


def own_500s(url: str) -> float:
    """``gateway_requests_total{backend="none", status="500"}``: the gateway's own 500s."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "gateway_requests_total" and s.labels.get("backend") == "none"
               and s.labels.get("status") == "500")


def problem(route: str, answer: Answer) -> str | None:
    """What is wrong with ``answer`` to a fuzzed body on ``route`` (None: nothing)."""
    if answer.status >= 500 and not answer.relayed:
        return f"the gateway answered {answer.status}"
    if answer.status >= 400:
        return None if is_openai_error(answer) else f"a {answer.status} whose body is not an OpenAI error"
    if answer.status != 200:
        return f"unexpected status {answer.status}"
    if route == "/v1/kappa/route":
        return None if "chosen" in json.loads(answer.body) else "an explanation without a chosen backend"
    return None if answer.relayed else "a 200 without x-kappa-backend"


@pytest.mark.parametrize("route", ROUTES)
def test_no_body_gets_a_gateway_5xx_a_non_openai_error_or_a_dropped_connection(gateway_url: str, route: str) -> None:
    conn = OneConnection(gateway_url)
    statuses: Counter[int] = Counter()  # of the fuzzed bodies' answers

    @FUZZ_SETTINGS
    @given(body=request_bodies(route))
    def send(body: bytes) -> None:
        try:
            answer = conn.post(route, body)
        except ConnectionLost as lost:
            conn.reopen()  # a clean start for the next example (hypothesis shrinking this one)
            raise AssertionError(f"the connection was lost ({lost}) on the body {body[:300]!r}") from lost
        wrong = problem(route, answer)
        assert wrong is None, f"{wrong}: {answer.body[:300]!r} for the body {body[:300]!r}"
        statuses[answer.status] += 1

    try:
        send()
        assert sum(statuses.values()) >= EXAMPLES_PER_ROUTE, statuses
        # The fuzz reached past the gateway's validation: some bodies were relayed or explained.
        assert statuses[200] > 0 and statuses[400] > 0, statuses
        last = conn.post(route, json.dumps(VALID[route]).encode())
        assert last.status == 200 and conn.reopened == 0
    finally:
        conn.close()
    assert own_500s(gateway_url) == 0
