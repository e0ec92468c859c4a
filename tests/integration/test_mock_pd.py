"""vLLM's NixlConnector P/D flow between real mock servers (`mock_vllm.pd`): a prefill answers
with ``kv_transfer_params`` and keeps its KV; a decode pulls only the blocks it lacks over the
modelled link, then decodes; failures follow ``kv_load_failure_policy``; a link fault shows in
vLLM's ``vllm:nixl_*`` metrics. Servers run at time-scale 0.01; expected figures are exact
(engine seconds), so nothing here waits on wall-clock time but the polls for a release."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.integration.pd_support import (
    BLOCK,
    BLOCK_BYTES,
    PREFILL_PARAMS,
    Mock,
    backend,
    complete,
    expected_transfer_s,
    fleet,
    prefill,
    prompt,
    serve,
)

pytestmark = pytest.mark.integration

# Nominal URLs: each test mock listens on a free port, and a prefill names its own in its params.
SETTINGS = fleet(backend("p", "prefill", 8001, hardware="b200"), backend("d", "decode", 8002),
                 backend("d-fail", "decode", 8003))
P = 20 * BLOCK + 5  # a prompt of 21 blocks, the last partial
WARM = 8 * BLOCK + 2  # d already holds the first 8 blocks
TRANSFER_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
                 "remote_host", "remote_port", "tp_size"}
POLL_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def p() -> Iterator[Mock]:
    with serve(SETTINGS, "p") as mock:
        yield mock


@pytest.fixture(scope="module")
def d() -> Iterator[Mock]:
    with serve(SETTINGS, "d", kv_load_failure_policy="recompute") as mock:
        yield mock


@pytest.fixture(scope="module")
def d_fail() -> Iterator[Mock]:
    with serve(SETTINGS, "d-fail") as mock:  # vLLM's default policy: fail
        yield mock


def poll(condition, what: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # poll interval, not a readiness guess


def external_tokens(mock: Mock) -> float:
    return mock.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_prefill_answers_with_the_params_and_keeps_its_blocks(p: Mock) -> None:
    params = prefill(p, prompt(P))
    assert set(params) == TRANSFER_KEYS
    assert (params["do_remote_prefill"], params["do_remote_decode"]) == (True, False)
    assert params["remote_engine_id"] == "p" and params["tp_size"] == 1
    assert f"http://{params['remote_host']}:{params['remote_port']}" == p.url
    assert len(params["remote_block_ids"]) == -(-P // BLOCK)  # every block of the prompt
    assert params["remote_request_id"] in p.engine.held_request_ids
    assert p.http.get("/kappa/nixl/meta").json()["kv_role"] == "prefill"
    assert p.http.post("/kappa/nixl/read", json={"remote_request_id": params["remote_request_id"],
                                                 "block_ids": [10**9]}).status_code == 409
    plain = complete(p, prompt(40), max_tokens=2).json()  # no params: served, freed, answered with null
    assert plain["kv_transfer_params"] is None and p.engine.held_request_ids == [params["remote_request_id"]]


def test_decode_pulls_only_the_blocks_it_lacks_over_the_modelled_link(p: Mock, d: Mock) -> None:
    ids = prompt(P)
    assert complete(d, ids[:WARM], max_tokens=1).status_code == 200  # d caches 8 full blocks
    params = prefill(p, ids)
    before_external, (before_bytes, before_s, before_n) = external_tokens(d), d.transfer_figures()
    resp = d.client.completions.create(model="llama-3.1-8b", prompt=ids, max_tokens=4,
                                       extra_body={"kv_transfer_params": params})
    assert resp.usage.completion_tokens == 4 and resp.usage.prompt_tokens == P
    # vLLM counts remotely computed tokens as cached: all but the recomputed last one.
    assert resp.usage.prompt_tokens_details.cached_tokens == P - 1
    assert external_tokens(d) - before_external == P - 8 * BLOCK  # P − K_d, by value
    pulled_bytes = (-(-P // BLOCK) - 8) * BLOCK_BYTES  # the 13 blocks d lacked, whole blocks
    after_bytes, after_s, after_n = d.transfer_figures()
    assert (after_bytes - before_bytes, after_n - before_n) == (pulled_bytes, 1)  # TP 1: one rank's read
    assert after_s - before_s == pytest.approx(expected_transfer_s(pulled_bytes), rel=1e-9)
    assert params["remote_request_id"] not in p.engine.held_request_ids  # the read's notification freed them
    again = complete(d, ids, max_tokens=1).json()  # the pulled blocks are d's cached blocks now
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (P - 1) // BLOCK * BLOCK


def test_a_slow_link_shows_in_the_delivered_bandwidth_and_recovers(p: Mock, d: Mock) -> None:
    def delivered_gb_s() -> float:
        before_bytes, before_s, _ = d.transfer_figures()
        ids = prompt(P)
        assert complete(d, ids, max_tokens=2, kv_transfer_params=prefill(p, ids)).status_code == 200
        after_bytes, after_s, _ = d.transfer_figures()
        return (after_bytes - before_bytes) / (after_s - before_s) / 1e9  # × tp_size 1

    try:
        faults = d.http.post("/kappa/faults/link", json={"peer": "p", "delivered_gb_s": 1.0}).json()
        assert faults == {"faults": {"p": {"delivered_gb_s": 1.0, "fail": False}}}
        slow = delivered_gb_s()
        assert slow == pytest.approx(21 * BLOCK_BYTES / expected_transfer_s(21 * BLOCK_BYTES, 1.0) / 1e9)
        assert 0.9 < slow < 1.0  # the 0.5 ms latency is in each transfer's time
    finally:
        assert d.http.delete("/kappa/faults/link").json() == {"faults": {}}
    assert delivered_gb_s() > 20  # 44 MB at 50 GB/s plus 0.5 ms


def test_a_failed_pull_recomputes_under_the_recompute_policy(p: Mock, d: Mock) -> None:
    ids = prompt(P)
    params = prefill(p, ids)
    failed = d.metric("vllm:nixl_num_failed_transfers_total")
    try:
        d.http.post("/kappa/faults/link", json={"peer": "*", "fail": True})
        resp = complete(d, ids, max_tokens=3, kv_transfer_params=params).json()
    finally:
        d.http.delete("/kappa/faults/link", params={"peer": "*"})
    assert resp["usage"]["completion_tokens"] == 3 and resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d.metric("vllm:nixl_num_failed_transfers_total") == failed + 1
    assert params["remote_request_id"] in p.engine.held_request_ids  # no read, no notification: p waits


def test_a_dead_prefill_fails_the_pull_and_the_fail_policy_answers_vllms_error(d: Mock, d_fail: Mock) -> None:
    ids = prompt(P)
    with serve(SETTINGS, "p") as doomed:
        params = prefill(doomed, ids)
    # p is gone: the side channel refuses the connection.
    failed = d_fail.metric("vllm:nixl_num_failed_transfers_total")
    resp = complete(d_fail, ids, max_tokens=3, kv_transfer_params=params)
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                     "param": None, "code": 500}}
    assert d_fail.metric("vllm:nixl_num_failed_transfers_total") == failed + 1
    with d_fail.http.stream("POST", "/v1/completions", json={"model": "llama-3.1-8b", "prompt": ids, "max_tokens": 3,
                                                             "stream": True, "kv_transfer_params": params}) as stream:
        events = [line for line in stream.iter_lines() if line]
    assert stream.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == 500
    recomputed = complete(d, ids, max_tokens=3, kv_transfer_params=params).json()  # recompute: served
    assert recomputed["usage"]["completion_tokens"] == 3


def test_held_blocks_are_freed_after_the_timeout(d: Mock) -> None:
    with serve(SETTINGS, "p", abort_request_timeout_s=2.0) as p:  # 2 engine s: 20 ms of wall time
        ids = prompt(P)
        params = prefill(p, ids)
        poll(lambda: p.engine.held_request_ids == [], "the held blocks to expire")
        assert p.metric("vllm:nixl_num_kv_expired_reqs_total") == 1
        assert p.engine.cache.num_free_blocks == p.engine.stats.num_gpu_blocks  # nothing referenced
        read = {"remote_request_id": params["remote_request_id"], "block_ids": params["remote_block_ids"]}
        assert p.http.post("/kappa/nixl/read", json=read).status_code == 404  # expired: nothing to read
        failed = d.metric("vllm:nixl_num_failed_transfers_total")
        assert complete(d, ids, max_tokens=2, kv_transfer_params=params).status_code == 200  # recomputed
        assert d.metric("vllm:nixl_num_failed_transfers_total") == failed + 1
