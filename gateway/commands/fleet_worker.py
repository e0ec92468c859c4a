"""One process serving some local mock backends of a config (``mock-fleet-worker``).

``kappa-gateway mock-fleet`` runs this hidden command for its mocks: one process per
backend, or, when the config has a ``kv_pool`` section, one process for all of them, since
they must share one `SharedKVPool` object (`mock_vllm.app_factory.shared_kv_pool`). Each mock
is `mock_vllm.app_factory.build_backend_app` of its backend entry — the same entry the
gateway routes by — one uvicorn server per backend on its own host and port, all on one
asyncio loop. A backend whose entry has ``kv_events`` publishes vLLM's KV events, bound on its
entry's endpoint and replay endpoint (`mock_vllm.app_factory.kv_events_config`).

SIGINT/SIGTERM stop every server together (uvicorn's own per-server handlers would each
replace the last, so only one server would hear a signal); then the process exits 0. A
server that cannot start (its port taken) stops the others and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI

from fleet_config import BackendEntry, Settings
from mock_vllm.app_factory import build_backend_app, kv_events_config, shared_kv_pool
from router.profiles import Catalog
from tokenization import EngineTokenizer

# uvicorn waits forever for open streams by default (STYLE.md B7); the same bound as mock-vllm's.
GRACEFUL_SHUTDOWN_S = 5.0
LOG_LEVEL = "warning"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ORPHAN_CHECK_S = 0.5  # how often a worker checks that mock-fleet, its parent, is still there


def build_apps(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry], *,
               time_scale: float, kv_events_encoding: str = "map", python_hash_seed: str | None = None,
               tokenizers: Mapping[str, EngineTokenizer] | None = None, **pd: Any) -> list[FastAPI]:
    """One mock app per backend (in order); with a ``kv_pool`` section, all on one shared pool.
    ``tokenizers``: served model name -> its tokenizer (`gateway.commands.tokenizers.model_tokenizers`);
    a model without one tokenises with the mock's own. ``pd``: the P/D keywords of `build_backend_app`
    (``kv_load_failure_policy``, ...); a backend with ``kv_events`` publishes them in
    ``kv_events_encoding``, hashes seeded by ``python_hash_seed``.

    Raises:
        ValueError: a bad setting (`shared_kv_pool`, `build_backend_app`).
    """
    kv_pool = shared_kv_pool(settings, catalog, backends) if settings.kv_pool is not None else None
    tokenizers = tokenizers or {}
    return [build_backend_app(settings, backend, catalog, time_scale=time_scale, kv_pool=kv_pool,
                              kv_events=kv_events_config(backend, encoding=kv_events_encoding,  # type: ignore[arg-type]
                                                         python_hash_seed=python_hash_seed),
                              tokenizer=tokenizers.get(backend.model), **pd)
            for backend in backends]


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to `serve_all`, which stops every server at once."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _stop_when_orphaned(stop_all: Callable[[], None]) -> None:
    """Stop every server once this worker's parent (``mock-fleet``) is gone: a parent killed by a
    signal it cannot catch (SIGKILL) ends no child, and the mocks would go on holding their ports.
    Polled every `ORPHAN_CHECK_S` (the parent pid changes when the worker is re-parented)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(ORPHAN_CHECK_S)
    logging.getLogger("kappa_gateway.mock_fleet").warning("mock-fleet (pid %d) is gone: stopping its mocks", parent)
    stop_all()


async def serve_all(apps: Sequence[FastAPI], urls: Sequence[str]) -> int:
    """Serve ``apps[i]`` on the host and port of ``urls[i]`` until SIGINT/SIGTERM, then stop them all.

    Returns:
        0 after a stop signal; uvicorn's exit status (3: startup failure, e.g. a port taken)
        when a server could not start, the others then being stopped too.
    """
    servers = [_Server(uvicorn.Config(app, host=urlsplit(url).hostname, port=urlsplit(url).port, lifespan="on",
                                      log_level=LOG_LEVEL, access_log=False,
                                      timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
               for app, url in zip(apps, urls, strict=True)]
    failures: list[int] = []

    def stop_all() -> None:
        for server in servers:
            server.should_exit = True

    async def serve(server: _Server) -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn's sys.exit on a failed start-up: stop the rest, report it
            failures.append(exc.code if isinstance(exc.code, int) else 1)
            stop_all()

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop_all)
    orphan_watch = asyncio.create_task(_stop_when_orphaned(stop_all), name="mock-fleet-orphan-watch")
    try:
        await asyncio.gather(*(serve(server) for server in servers))
    finally:
        orphan_watch.cancel()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return failures[0] if failures else 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed, else asyncio's loop: uvicorn's ``loop="auto"``, as ``mock-vllm`` runs."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_fleet(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry], *, time_scale: float,
              tokenizers: Mapping[str, EngineTokenizer] | None = None, **pd: Any) -> int:
    """Build the mocks of ``backends`` and serve them until a stop signal (blocks).

    Returns:
        The process exit status (`serve_all`).

    Raises:
        ValueError: a bad setting (`build_apps`).
    """
    apps = build_apps(settings, catalog, backends, time_scale=time_scale, tokenizers=tokenizers, **pd)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve_all(apps, [b.url for b in backends]))
