"""The access log: one line per request, JSON when configured, and no secret or prompt text in
any log line at any level. A real ``kappa-gateway serve`` process at ``--log-level trace``
(which crashed at start-up on 65d19c0) in front of a real fake upstream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.commands.processes import free_port, stop_processes
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll
from tests.reliability.relay_support import REPO_ROOT, get_status
from tests.support.fake_upstream import Script, make_app
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CLIENT_KEY = "client-key-7f3a91"
ADMIN_KEY = "admin-key-c0ffee42"
PROMPT = "PROMPT-TEXT-d41d8cd9 the secret plan"
SECRET_HEADER = "x-private-token-value-5150"


def serve(tmp_path: Path, upstream: str, log_level: str, fmt: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump({
        "gateway": {"port": port, "api_keys": [CLIENT_KEY], "access_log_format": fmt, "health_interval_s": 0.1,
                    "shutdown_drain_delay_s": 0},
        "backends": [backend_doc("b0", upstream)]}))
    log = tmp_path / f"gateway-{log_level}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                 "--log-level", log_level], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**__import__("os").environ, "KAPPA_ADMIN_API_KEY": ADMIN_KEY})
    url = f"http://127.0.0.1:{port}"
    poll(lambda: proc.poll() is None and get_status(url, "/ready") == 200, "the gateway to be ready", timeout_s=30)
    return proc, url, log


def traffic(url: str) -> None:
    body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    auth = {"authorization": f"Bearer {CLIENT_KEY}", "x-custom": SECRET_HEADER}
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/chat/completions", json=body, headers={**auth, "x-request-id": "req-one"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**body, "stream": True},
                         headers={**auth, "x-request-id": "req-two"}).status_code == 200
        assert http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer wrong-key-9"}
                         ).status_code == 401
        assert http.post("/v1/chat/completions", json={**body, "model": "no-such-model"}, headers=auth).status_code == 404
        assert http.get("/v1/kappa/backends", headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200


@pytest.mark.parametrize("log_level", ["trace", "info"])
def test_one_json_access_line_per_request_and_no_secret_or_prompt_in_any_line(tmp_path: Path, log_level: str) -> None:
    with serve_in_thread(make_app(Script())) as upstream:
        proc, url, log = serve(tmp_path, upstream, log_level, "json")
        try:
            traffic(url)
        finally:
            stop_processes([proc])
    text = log.read_text(errors="replace")
    for secret in (CLIENT_KEY, ADMIN_KEY, "wrong-key-9", SECRET_HEADER, "PROMPT-TEXT", "the secret plan"):
        assert secret not in text, f"{secret!r} reached the log at level {log_level}"
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    by_id = {line["request_id"]: line for line in lines}
    assert len(lines) == 4, lines  # the two answered, the 401 and the 404: one line each
    one, two = by_id["req-one"], by_id["req-two"]
    assert one["status"] == 200 and one["outcome"] == "ok" and one["backend"] == "b0" and one["model"] == MOCK_MODEL
    assert one["route"] == "chat" and one["regime"] in ("compute", "transfer") and one["e2e_s"] > 0
    assert one["request_bytes"] > len(PROMPT) and one["response_bytes"] > 0 and one["ttft_s"] is None
    assert two["ttft_s"] is not None and two["ttft_s"] <= two["e2e_s"]
    assert {line["status"] for line in lines if line["backend"] == "none"} == {401, 404}
    assert all(line["model"] is None for line in lines if line["backend"] == "none")  # a client's model: never logged
