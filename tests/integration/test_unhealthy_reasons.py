"""Every backend out of rotation says why, from its first failed check (issue 27, item 2).

A config pointing at a port where nothing listens used to log only ``gateway ready: 0/1 backends
healthy``, and ``/v1/kappa/backends`` said ``healthy: false`` with no reason; a backend down later
was logged, one never up was not. Real gateways, in front of a port nothing listens on, a real
upstream whose ``/health`` answers 503, and one that serves another model.
"""

from __future__ import annotations

import logging

import pytest

from gateway.commands.processes import free_port
from tests.integration.gateway_support import backend_doc, poll, run_gateway
from tests.support.misbehaving_upstream import misbehaving_upstream

pytestmark = pytest.mark.integration


def reasons(gw) -> dict[str, str | None]:  # type: ignore[no-untyped-def]
    return {b["id"]: b["unhealthy_reason"] for b in gw.http.get("/v1/kappa/backends").json()["backends"]}


def test_each_backend_not_up_says_why_in_the_api_the_log_and_the_start_up_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kappa_gateway")
    nowhere = f"http://127.0.0.1:{free_port()}"
    with misbehaving_upstream() as failing, misbehaving_upstream() as up, misbehaving_upstream() as other:
        failing.health_status = 503
        docs = [backend_doc("refused", nowhere), backend_doc("sick", failing.url), backend_doc("up", up.url),
                backend_doc("other", other.url, model="llama-3.1-70b")]  # it lists llama-3.1-8b only
        with run_gateway(docs) as gw:
            def every_reason() -> dict[str, str | None] | None:
                now = reasons(gw)
                return now if all(now[b] is not None for b in ("refused", "sick", "other")) else None

            why = poll(every_reason, "a reason for each backend not up")
            assert why["up"] is None
            assert "unreachable" in why["refused"] and "Connect" in why["refused"], why["refused"]
            assert why["sick"] == "GET /health answered HTTP 503"
            assert "not the configured model 'llama-3.1-70b'" in why["other"], why["other"]
            def failures(backend: str) -> int:
                view = {b["id"]: b for b in gw.http.get("/v1/kappa/backends").json()["backends"]}
                return view[backend]["health_check_failures"]

            poll(lambda: failures("sick") >= 6, "more failed checks of the same kind (they log nothing more)")
            failing.health_status = 200
            poll(lambda: reasons(gw)["sick"] is None, "the sick backend up once /health answers 200")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kappa_gateway")]
    ready = next(m for m in lines if m.startswith("gateway ready:"))
    assert "1/4 backends healthy; not up: " in ready or "0/4 backends healthy; not up: " in ready, ready
    assert "refused (backend unreachable" in ready and "sick (GET /health answered HTTP 503)" in ready, ready
    for backend in ("refused", "sick", "other"):
        said = [m for m in lines if m.startswith(f"backend {backend} is not up:")]
        assert len(said) == 1, (backend, said)  # one line per change, not one per check
    assert any(m == "backend sick is up" for m in lines)
