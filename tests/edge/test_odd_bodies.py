"""Odd but possible bodies on the three POST routes: each is refused by the gateway with an
OpenAI-shaped 4xx naming the field, or accepted (relayed to a backend, or explained) — never a
5xx of the gateway's own, never a dropped connection (issue 16).

What the gateway refuses and why is `gateway.routing`'s module docstring: not JSON that
orjson accepts (NaN, a lone surrogate, a number past a double, invalid UTF-8), or the fields
routing reads (``model``, ``messages``/``prompt``, ``stream``, ``max_tokens``) of a shape no
OpenAI server takes. Everything else is the backend's to judge: the mock, like vLLM, answers
a 4xx of its own for some (``n`` as a string, ``stream_options`` not an object, a batch of
token-id prompts, ``max_tokens`` past the context), relayed with ``x-kappa-backend``.
One keep-alive connection per route serves the whole table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.gateway_support import MOCK_MODEL, Gateway, backend_doc, poll, run_gateway, run_mocks
from tests.support.keepalive import OneConnection, is_openai_error

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MOCK_MODEL, "messages": HI, "max_tokens": 1}
PROMPT = {"model": MOCK_MODEL, "prompt": "hi", "max_tokens": 1}
M = MOCK_MODEL.encode()


def js(doc: dict) -> bytes:
    return json.dumps(doc).encode()


# (id, kind, body, expected): expected is ("refused", status, param) — the gateway's own
# answer — or ("accepted", status the backend gives it on the proxy route). ANY_PARAM: the
# canonicaliser's errors name the field in the message, and ``param`` is the routed field
# (``messages``/``prompt``) even where the fault is elsewhere (``tools``).
ANY_PARAM = object()
CASES = [
    ("max-tokens-past-2**64", "chat", js({**CHAT, "max_tokens": 2**64}), ("refused", 400, "max_tokens")),
    ("max-tokens-2**63", "chat", js({**CHAT, "max_tokens": 2**63}), ("accepted", 400)),  # past the context
    ("max-tokens-float", "chat", js({**CHAT, "max_tokens": 1.5}), ("refused", 400, "max_tokens")),
    ("max-tokens-bool", "chat", js({**CHAT, "max_tokens": True}), ("refused", 400, "max_tokens")),
    ("nan", "chat", b'{"model": "%s", "messages": [], "temperature": NaN}' % M, ("refused", 400, None)),
    ("infinity", "chat", b'{"model": "%s", "messages": [], "top_p": -Infinity}' % M, ("refused", 400, None)),
    ("number-past-a-double", "chat", js(CHAT)[:-1] + b', "seed": 1e400}', ("refused", 400, None)),
    ("role-int", "chat", js({**CHAT, "messages": [{"role": 5, "content": "x"}]}), ("refused", 400, "messages")),
    ("part-not-object", "chat", js({**CHAT, "messages": [{"role": "user", "content": [5]}]}),
     ("refused", 400, "messages")),
    ("tools-not-list", "chat", js({**CHAT, "tools": "x"}), ("refused", 400, ANY_PARAM)),
    ("n-string", "chat", js({**CHAT, "n": "2"}), ("refused", 400, "n")),  # n sizes the KV charge: validated
    ("stream-options-list", "chat", js({**CHAT, "stream": True, "stream_options": [1]}), ("accepted", 400)),
    ("stream-options-odd", "chat", js({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}),
     ("accepted", 200)),
    ("stream-null", "chat", js({**CHAT, "stream": None}), ("accepted", 200)),
    ("stream-string", "chat", js({**CHAT, "stream": "yes"}), ("refused", 400, "stream")),
    ("lone-surrogate", "chat", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % M,
     ("refused", 400, None)),
    ("invalid-utf8", "chat", b'{"model": "%s", "messages": [{"role": "user", "content": "\xff"}]}' % M,
     ("refused", 400, None)),
    ("bom", "chat", b"\xef\xbb\xbf" + js(CHAT), ("accepted", 200)),  # RFC 8259 §8.1: a parser may ignore it
    ("model-number", "chat", js({**CHAT, "model": 5}), ("refused", 400, "model")),
    ("model-unknown", "chat", js({**CHAT, "model": "gpt-9"}), ("refused", 404, "model")),
    ("duplicate-keys", "chat", b'{"model": "other", ' + js(CHAT)[1:], ("accepted", 200)),  # the last wins, as in vLLM
    ("cache-salt-number", "chat", js({**CHAT, "cache_salt": 5}), ("refused", 400, "cache_salt")),
    ("empty", "chat", b"", ("refused", 400, None)),
    ("null", "chat", b"null", ("refused", 400, None)),
    ("array", "chat", b"[1, 2]", ("refused", 400, None)),
    ("nested-too-deep", "chat", b"[" * 2_000 + b"]" * 2_000, ("refused", 400, None)),
    ("prompt-batch-of-ids", "completion", js({**PROMPT, "prompt": [[1, 2], [3]]}), ("accepted", 400)),
    ("prompt-ids-with-bools", "completion", js({**PROMPT, "prompt": [[True, 2]]}), ("refused", 400, "prompt")),
    ("prompt-bools", "completion", js({**PROMPT, "prompt": [True]}), ("refused", 400, "prompt")),
    ("prompt-id-past-2**64", "completion", js({**PROMPT, "prompt": [2**64]}), ("refused", 400, "prompt")),
    ("prompt-ids", "completion", js({**PROMPT, "prompt": [1, 2, 3]}), ("accepted", 200)),
]
ROUTE = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with run_mocks(2) as urls, run_gateway([backend_doc("a", urls[0]), backend_doc("b", urls[1], "b200")]) as g:
        poll(lambda: g.http.get("/ready").status_code == 200, "gateway ready")
        yield g


@pytest.fixture(scope="module")
def conns(gw: Gateway) -> Iterator[dict[str, OneConnection]]:
    """One keep-alive connection per route for the whole table; each must still be the same at the end."""
    out = {route: OneConnection(gw.url) for route in (*ROUTE.values(), "/v1/kappa/route")}
    yield out
    for conn in out.values():
        assert conn.reopened == 0
        conn.close()


@pytest.mark.parametrize(("kind", "body", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("explain", [False, True], ids=["proxy", "explain"])
def test_odd_body(conns: dict[str, OneConnection], kind: str, body: bytes, expected: tuple, explain: bool) -> None:
    route = "/v1/kappa/route" if explain else ROUTE[kind]
    answer = conns[route].post(route, body)
    if expected[0] == "refused":
        _, status, param = expected
        assert answer.status == status and not answer.relayed and is_openai_error(answer), answer
        assert param is ANY_PARAM or json.loads(answer.body)["error"]["param"] == param
    elif explain:
        assert answer.status == 200 and json.loads(answer.body)["chosen"] in {"a", "b"}, answer
    else:
        assert answer.status == expected[1] and answer.relayed, answer
        assert answer.status == 200 or is_openai_error(answer), answer
