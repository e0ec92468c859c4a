"""Request bodies at the edge: Content-Encoding, admission caps, echoed values, memory per body.

A real gateway in front of a real fake upstream that records what reached it. On 65d19c0 a
gzip body was "Invalid JSON body", nothing capped requests or body bytes in flight, a 2 MB
model name came back in a 2 MB 404, and a client's X-Request-Id was echoed whatever it held.
"""

from __future__ import annotations

import gzip
import json
import threading
import zlib

import httpx
import pytest

from tests.integration.gateway_support import backend_doc, poll, run_fakes, run_gateway
from tests.support.fake_upstream import Script

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "compressed " * 200}]}
RAW = json.dumps(BODY).encode()


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == resp.status_code
    return err


@pytest.mark.parametrize("coding, encoded", [
    ("gzip", gzip.compress(RAW)),
    ("deflate", zlib.compress(RAW)),  # RFC 9110's deflate: zlib data
    ("deflate", zlib.compress(RAW, wbits=-15)),  # raw deflate, as some clients send it
    ("gzip, gzip", gzip.compress(gzip.compress(RAW))),  # applied in order, decoded in reverse
], ids=["gzip", "deflate-zlib", "deflate-raw", "gzip-twice"])
def test_a_compressed_body_is_decoded_routed_and_forwarded_decoded(coding: str, encoded: bytes) -> None:
    script = Script()
    with run_fakes([script]) as (url,), run_gateway([backend_doc("b0", url)]) as gw:
        resp = gw.http.post("/v1/chat/completions", content=encoded,
                            headers={"content-encoding": coding, "content-type": "application/json"})
        assert resp.status_code == 200, resp.text
        (received,) = script.received
        assert received["body"] == RAW
        assert "content-encoding" not in received["headers"]
        assert int(received["headers"]["content-length"]) == len(RAW)


def test_an_unsupported_coding_is_415_naming_it_and_a_corrupt_one_400() -> None:
    with run_fakes([Script()]) as (url,), run_gateway([backend_doc("b0", url)]) as gw:
        resp = gw.http.post("/v1/chat/completions", content=b"\x1b\x00", headers={"content-encoding": "br"})
        assert resp.status_code == 415 and "'br'" in error_of(resp)["message"]
        resp = gw.http.post("/v1/chat/completions", content=gzip.compress(RAW)[:-9],
                            headers={"content-encoding": "gzip"})
        assert resp.status_code == 400 and "gzip" in error_of(resp)["message"]
        resp = gw.http.post("/v1/kappa/route", content=gzip.compress(RAW), headers={"content-encoding": "gzip"})
        assert resp.status_code == 200 and resp.json()["model"] == MODEL


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain; charset=utf-8",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_is_415_naming_its_content_type(content_type: str) -> None:
    """curl's -d sends a form Content-Type: the gateway says so, where the backend (vLLM's FastAPI) would
    answer "1 validation error: body: Input should be a valid dictionary" after a round trip (issue 27)."""
    script = Script()
    with run_fakes([script]) as (url,), run_gateway([backend_doc("b0", url)]) as gw:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/kappa/route"):
            resp = gw.http.post(path, content=RAW, headers={"content-type": content_type})
            err = error_of(resp)
            assert resp.status_code == 415 and err["type"] == "invalid_request_error", resp.text
            media = content_type.split(";")[0]
            assert f"'{media}'" in err["message"] and "application/json" in err["message"]
        assert script.received == []  # refused at the edge, no backend round trip
        for fine in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", None):
            headers = {} if fine is None else {"content-type": fine}
            resp = gw.http.post("/v1/chat/completions", content=RAW, headers=headers)
            assert resp.status_code == 200, (fine, resp.text)


def test_a_decompression_bomb_stops_at_the_body_limit() -> None:
    bomb = gzip.compress(b"{" + b" " * (64 * 1024 * 1024) + b"}")  # 64 MiB of JSON in ~64 KB
    with run_fakes([Script()]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"max_body_bytes": 1024 * 1024}) as gw:
        resp = gw.http.post("/v1/chat/completions", content=bomb, headers={"content-encoding": "gzip"})
        assert resp.status_code == 413 and "decoded" in error_of(resp)["message"]


def test_requests_above_the_in_flight_cap_get_503_with_retry_after_until_one_ends() -> None:
    hang = Script(mode="hang")
    with run_fakes([hang]) as (url,), \
            run_gateway([backend_doc("b0", url)], gateway={"max_in_flight_requests": 1,
                                                           "upstream_first_byte_timeout_s": 3}) as gw:
        held = threading.Thread(target=lambda: gw.http.post("/v1/chat/completions", json=BODY))
        held.start()
        poll(lambda: len(hang.received) == 1, "the first request to reach the hanging upstream")
        resp = gw.http.post("/v1/chat/completions", json=BODY)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert error_of(resp)["type"] == "service_unavailable_error" and resp.headers["x-request-id"]
        assert gw.metric("gateway_requests_total", backend="none", status="503") == 1
        held.join()  # the first times out (504) and gives its slot back
        hang.mode = "ok"
        assert gw.http.post("/v1/chat/completions", json=BODY).status_code == 200


def test_body_bytes_above_the_in_flight_budget_get_503() -> None:
    hang = Script(mode="hang")
    limits = {"max_body_bytes": 4096, "max_in_flight_body_bytes": 6000, "upstream_first_byte_timeout_s": 3}
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3500}]}
    with run_fakes([hang]) as (url,), run_gateway([backend_doc("b0", url)], gateway=limits) as gw:
        held = threading.Thread(target=lambda: gw.http.post("/v1/chat/completions", json=big))
        held.start()
        poll(lambda: len(hang.received) == 1, "the first body to be held at the hanging upstream")
        resp = gw.http.post("/v1/chat/completions", json=big)
        assert resp.status_code == 503 and "body bytes" in error_of(resp)["message"]
        assert gw.http.post("/v1/chat/completions", json=BODY).status_code != 503  # a small one still fits
        held.join()
        assert gw.app.state.gateway.admission.body_bytes == 0


def test_echoed_values_are_truncated_and_unsafe_request_ids_replaced() -> None:
    with run_fakes([Script()]) as (url,), run_gateway([backend_doc("b0", url)]) as gw:
        resp = gw.http.post("/v1/chat/completions", json={**BODY, "model": "m" * 2_000_000})
        assert resp.status_code == 404 and len(resp.content) < 1000
        assert "(2000000 characters)" in error_of(resp)["message"]
        for bad in ("x" * 5000, "id with spaces", "é"):
            resp = gw.http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": bad.encode("utf-8")})
            assert resp.status_code == 200 and resp.headers["x-request-id"] != bad
            assert len(resp.headers["x-request-id"]) == 32
        resp = gw.http.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "trace-42.a:b"})
        assert resp.headers["x-request-id"] == "trace-42.a:b"
