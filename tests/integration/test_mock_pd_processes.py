"""A prefill mock in a process of its own (``kappa-gateway mock-fleet``'s worker, with its P/D
flags), stopped with SIGSTOP mid-flow: the decode mock's pull times out and ``recompute`` serves
the request anyway. The stopped process is this test's child, continued and stopped by its pid."""

from __future__ import annotations

import os
import signal
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port
from tests.integration.pd_support import MODEL, PREFILL_PARAMS, fleet, prompt, serve

pytestmark = pytest.mark.integration

PULL_TIMEOUT_S = 0.5


def test_a_stopped_prefill_process_fails_the_pull_and_recompute_serves_it() -> None:
    p_url = f"http://127.0.0.1:{free_port()}"
    # d's URL is not on this machine, so mock-fleet starts only p; d runs in this process.
    settings = fleet({"id": "p", "url": p_url, "model": MODEL, "hardware": "b200", "kv_role": "prefill"},
                     {"id": "d", "url": "http://192.0.2.1:8002", "model": MODEL, "hardware": "h100-sxm",
                      "kv_role": "decode"})
    flags = ["--kv-load-failure-policy", "recompute", "--kv-abort-request-timeout-s", "60"]
    with mock_fleet(settings, time_scale=0.01, worker_flags=flags) as [mock], \
            serve(settings, "d", kv_load_failure_policy="recompute", pull_timeout_s=PULL_TIMEOUT_S) as d, \
            httpx.Client(base_url=p_url, timeout=30) as p:
        meta = p.get("/kappa/nixl/meta").json()
        assert (meta["engine_id"], meta["kv_role"], meta["kv_load_failure_policy"]) == ("p", "prefill", "recompute")
        ids = prompt(300)
        answer = p.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "stream": False,
                                                  "kv_transfer_params": PREFILL_PARAMS}).json()
        params = answer["kv_transfer_params"]
        assert f"http://{params['remote_host']}:{params['remote_port']}" == p_url
        assert urlsplit(p_url).port == params["remote_port"]
        failed = d.metric("vllm:nixl_num_failed_transfers_total")
        os.kill(mock.proc.pid, signal.SIGSTOP)
        try:
            resp = d.http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                        "kv_transfer_params": params})
        finally:
            os.kill(mock.proc.pid, signal.SIGCONT)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d.metric("vllm:nixl_num_failed_transfers_total") == failed + 1
        # (Continued, p may still act on the read d gave up on and free the blocks: a late notification.)
