"""An exception no handler answers gets an OpenAI-shaped 500 and the connection stays open.

Starlette's own last resort answers a plain-text 500 and re-raises, and uvicorn then closes
the keep-alive connection (issue 16: the client's next, innocent request on it failed).
The gateway's app (`gateway.app.create_app`, served by uvicorn on 127.0.0.1) is given one
extra route that raises, as a bug in any FastAPI route would.
"""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from fleet_config import default_catalog, parse_settings
from gateway.app import create_app
from tests.support.keepalive import OneConnection, is_openai_error
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

SETTINGS = parse_settings({"backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b",
                                         "hardware": "h100-sxm"}]}, default_catalog(), env={})


class Bug(Exception):
    pass


async def broken() -> dict:
    raise Bug("a bug in a route")


def test_an_unhandled_exception_is_an_openai_500_on_a_kept_connection(caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(SETTINGS, registry=CollectorRegistry())
    app.add_api_route("/v1/kappa/broken", broken, methods=["POST"])
    with serve_in_thread(app, proxy_headers=False) as url, caplog.at_level(logging.ERROR, "kappa_gateway.app"):
        conn = OneConnection(url)
        try:
            answer = conn.post("/v1/kappa/broken", b"{}")
            assert answer.status == 500 and is_openai_error(answer), answer
            assert json.loads(answer.body)["error"] == {"message": "Internal server error.", "type": "server_error",
                                                        "param": None, "code": 500}
            # The same connection serves the next request (a 400 of the explain route's own).
            follow = conn.post("/v1/kappa/route", b"[]")
            assert follow.status == 400 and is_openai_error(follow)
        finally:
            conn.close()
    bugs = [r for r in caplog.records if r.getMessage().startswith("unhandled Bug while serving a request")]
    assert len(bugs) == 1, [r.getMessage() for r in caplog.records]
    # The exception's message may quote a body: it is withheld (the stack shows code, not values).
    assert "Bug: a bug in a route" not in bugs[0].getMessage() and bugs[0].exc_info is None
    assert "in broken" in bugs[0].getMessage()  # the stack says where
