"""Faults on each phase of a split request (issue 26; `bench/faults.py --pd` runs them under load).

- A prefill backend SIGSTOPped while its prefill phase is in flight: once its health checks take it
  out of rotation the phase ends (`gateway.proxy.disagg`, as `first_byte` moves an attempt) and the
  request goes whole to its decode backend, long before the first-byte deadline (before the fix:
  held until that deadline).
- A link that fails every KV pull, the decode mocks on vLLM's ``kv_load_failure_policy: fail``: a
  split stream's decode phase opens with an error event; the gateway retries the request whole on
  the other decode backend, so the client gets a clean stream (before the fix: the error event).
- A client that leaves during the prefill phase: the prefill mock aborts the request (nothing
  running, no KV held) and no decode phase is sent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fleet_config import default_catalog, parse_settings
from gateway.commands.processes import stop_processes
from mock_vllm.app_factory import build_backend_app
from tests.integration.gateway_support import Gateway, poll, run_gateway
from tests.reliability.relay_support import REPO_ROOT, get_status, host_port
from tests.support.redis_server import free_port
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

MODEL = "llama-3.1-8b"
CATALOG = default_catalog()
INTERCONNECT = {"default": {"bandwidth_gb_s": 50, "latency_s": 0.0005, "kind": "rdma"}}
LONG_PROMPT = " ".join(f"w{i}" for i in range(3000))  # ~3.4k tokens: split (tests/integration/test_gateway_pd.py)
HARDWARE = {"prefill": "b200", "decode": "h100-sxm"}


def doc(bid: str, role: str, url: str) -> dict[str, Any]:
    return {"id": bid, "url": url, "model": MODEL, "hardware": HARDWARE[role], "kv_role": role}


def mock_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@contextmanager
def fleet(roles: dict[str, str], *, time_scale: dict[str, float] | None = None, chunk_tokens: int | None = None,
          process: str | None = None, tmp_path: Path | None = None,
          gateway: dict[str, Any] | None = None) -> Iterator[tuple[Gateway, dict[str, str], subprocess.Popen | None]]:
    """Mocks of ``roles`` (id → role) in threads, but ``process``'s, a child process (one a test may
    SIGSTOP: always SIGCONT-ed and ended by its pid), and a gateway in front of them; ``chunk_tokens``:
    the thread mocks' ``max_num_batched_tokens`` (a long prefill then runs over several steps)."""
    ports = {bid: free_port() for bid in roles}
    docs = [doc(bid, role, f"http://127.0.0.1:{ports[bid]}") for bid, role in roles.items()]
    settings = parse_settings({"models": {MODEL: {"profile": MODEL}}, "interconnect": INTERCONNECT, "backends": docs},
                              CATALOG, env={})
    scales = time_scale or {}
    proc = None
    with ExitStack() as stack:
        urls = {}
        for b in settings.backends:
            if b.id == process:
                continue
            urls[b.id] = stack.enter_context(serve_in_thread(build_backend_app(
                settings, b, CATALOG, time_scale=scales.get(b.id, 0.01), registry=CollectorRegistry(),
                **({"max_num_batched_tokens": chunk_tokens} if chunk_tokens else {}))))
        if process is not None:
            assert tmp_path is not None
            path = tmp_path / "fleet.yaml"
            path.write_text(yaml.safe_dump({"models": {MODEL: {"profile": MODEL}}, "interconnect": INTERCONNECT,
                                            "backends": docs}))
            proc = subprocess.Popen([sys.executable, "-m", "gateway", "mock-vllm", "--config", str(path), "--backend",
                                     process, "--time-scale", str(scales.get(process, 0.01)), "--log-level",
                                     "warning"], cwd=REPO_ROOT)
            stack.callback(lambda: (proc.poll() is None and os.kill(proc.pid, signal.SIGCONT),
                                    stop_processes([proc], timeout_s=5)))
            urls[process] = f"http://127.0.0.1:{ports[process]}"
            poll(lambda: proc.poll() is None and get_status(urls[process], "/health") == 200,
                 f"mock {process} to answer /health", timeout_s=20)
        gw = stack.enter_context(run_gateway([doc(bid, role, urls[bid]) for bid, role in roles.items()],
                                             models={MODEL: {"profile": MODEL}}, interconnect=INTERCONNECT,
                                             gateway={"health_interval_s": 0.1, **(gateway or {})}))
        poll(lambda: all(b["healthy"] for b in gw.http.get("/v1/kappa/backends").json()["backends"]), "all healthy")
        yield gw, urls, proc


def test_a_sigstopped_prefill_backend_leaves_rotation_and_its_request_goes_whole_to_decode(tmp_path: Path) -> None:
    with fleet({"p": "prefill", "d": "decode"}, process="p", tmp_path=tmp_path,
               gateway={"upstream_first_byte_timeout_s": 60}) as (gw, _, proc):
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)  # SIGCONT-ed by the fleet's exit
        began = time.monotonic()
        resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4},
                            timeout=20)
        elapsed_s = time.monotonic() - began
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert "x-kappa-prefill-backend" not in resp.headers and resp.headers["x-kappa-backend"] == "d"
        assert gw.metric("gateway_pd_prefill_fallbacks_total", prefill_backend="p") == 1
        assert elapsed_s < 10, elapsed_s  # its health checks (2 s probe timeout, 3 in a row), not the 60 s deadline


def test_a_split_stream_whose_kv_pull_fails_is_retried_whole_on_another_decode_backend() -> None:
    with fleet({"p": "prefill", "d0": "decode", "d1": "decode"}) as (gw, urls, _):
        for d in ("d0", "d1"):  # every pull fails; vLLM's default policy "fail" answers it as an error
            assert httpx.post(urls[d] + "/kappa/faults/link", json={"peer": "*", "fail": True}).status_code == 200
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5, "stream": True}
        with gw.http.stream("POST", "/v1/completions", json=body) as resp:
            raw = b"".join(resp.iter_bytes())
        assert resp.status_code == 200 and "x-kappa-prefill-backend" not in resp.headers
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events), raw[:500]
        assert sum(bool(orjson.loads(e)["choices"][0]["text"]) for e in events[:-1]) == 5
        assert gw.metric("gateway_pd_splits_total") == 1 and gw.metric("gateway_upstream_retries_total") == 1
        # Not streamed: the decode phase answers 500, retried whole the same way.
        resp = gw.http.post("/v1/completions", json={**body, "stream": False, "prompt": "again " + LONG_PROMPT})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5


def test_a_client_leaving_during_the_prefill_phase_cancels_both_phases() -> None:
    # The prefill mock runs 20x slower than real time, its prefill in chunks of 256 tokens (so it
    # shows as running between steps): the ~0.07 s prefill lasts over a second.
    with fleet({"p": "prefill", "d": "decode"}, time_scale={"p": 20.0}, chunk_tokens=256) as (gw, urls, _):
        body = orjson.dumps({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "stream": True})
        host, port = host_port(gw.url)
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            poll(lambda: mock_metric(urls["p"], "vllm:num_requests_running") == 1, "the prefill phase running on p")
        # The client has gone: p aborts the prefill (nothing running, no KV held), d never gets a request.
        poll(lambda: mock_metric(urls["p"], "vllm:num_requests_running") == 0, "p's prefill aborted", timeout_s=5)
        assert httpx.get(urls["p"] + "/kappa/nixl/meta").json()["held_request_ids"] == []
        assert mock_metric(urls["d"], "vllm:num_requests_running") == 0
        assert mock_metric(urls["d"], "vllm:request_success_total") == 0
        poll(lambda: gw.metric("gateway_requests_total", status="client_disconnect") == 1, "the disconnect counted")
        assert gw.metric("gateway_pd_splits_total") == 0
