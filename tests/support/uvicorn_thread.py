"""Serve an ASGI app with uvicorn in a background thread on 127.0.0.1, port 0.

Imports none of the project's packages (STYLE.md B2), so the gateway tests can reuse it.
Readiness is polled on ``server.started`` (httpx's ``serve_in_thread``, aiohttp's
``BaseTestServer``), never slept for; shutdown sets ``should_exit`` and joins the thread,
with uvicorn's graceful-shutdown timeout set so open streams cannot hold it forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

STARTUP_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = 2.0
POLL_INTERVAL_S = 0.005


@contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                    graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S, **config: Any) -> Iterator[str]:
    """Run ``app`` until the block exits; yield its base URL (``http://127.0.0.1:<port>``).

    Args:
        app: an ASGI application (its lifespan runs).
        host: interface to bind; loopback by default.
        port: port to bind (0: a free one, the default; a fixed one to restart a server in place).
        startup_timeout_s: how long to wait for ``server.started``, s.
        graceful_shutdown_s: uvicorn's ``timeout_graceful_shutdown``, s.
        config: further `uvicorn.Config` keywords (e.g. ``log_level``).

    Raises:
        RuntimeError: the server thread ended before it started (lifespan failure, bind error).
        TimeoutError: it did not start within ``startup_timeout_s``.
    """
    config.setdefault("log_level", "warning")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="on",
                                           timeout_graceful_shutdown=graceful_shutdown_s, **config))
    thread = threading.Thread(target=server.run, name="uvicorn-test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn exited before it started (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {startup_timeout_s} s")
            time.sleep(POLL_INTERVAL_S)  # poll interval, not a readiness guess
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout_s + graceful_shutdown_s)
