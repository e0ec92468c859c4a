"""One process serving every local mock backend of a config, all on one fleet-shared KV pool.

``kappa-gateway mock-fleet`` runs this (as the hidden ``mock-fleet-worker`` command) when
the config has a ``kv_pool`` section: the mocks must share one `SharedKVPool` object, so
they live in one process, one uvicorn server per backend on its own host and port, all on
one asyncio loop. Each mock is built as ``kappa-gateway mock-vllm`` builds it
(`gateway.fleet.mock_command` names the same figures), plus the pool and its pool link
from `Settings.backend_spec`.

SIGINT/SIGTERM stop every server together (uvicorn's own per-server handlers would each
replace the last, so only one server would hear a signal); then the process exits 0. A
server that cannot start (its port taken) stops the others and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI

from gateway.settings import BackendEntry, Settings
from mock_vllm.app_factory import build_app
from mock_vllm.kv_cache import SharedKVPool
from mock_vllm.types import EngineConfig
from router import kappa
from router.profiles import GB, Catalog

# uvicorn waits forever for open streams by default (STYLE.md B7); the same bound as mock-vllm's.
GRACEFUL_SHUTDOWN_S = 5.0
LOG_LEVEL = "warning"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def pool_num_blocks(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry]) -> int:
    """The pool's capacity in KV blocks: capacity_gb · 10^9 // bytes of one block.

    A block is `EngineConfig.block_size_tokens` (16) tokens of the first backend's model
    (B_kv from `router.kappa`). Mocks of several models share the pool without hitting each
    other's blocks (each names them within its model's namespace), but it is sized in the
    first model's blocks.

    Raises:
        ValueError: no kv_pool section, no backends, or a capacity below one block.
    """
    if settings.kv_pool is None or not backends:
        raise ValueError("a shared KV pool needs a kv_pool section and at least one local backend")
    model = settings.model_profile(catalog, backends[0].model)
    block_bytes = kappa.b_kv_bytes(model) * EngineConfig().block_size_tokens
    try:
        return SharedKVPool.with_capacity(settings.kv_pool.capacity_gb * GB, block_bytes).num_blocks
    except ValueError:
        raise ValueError(f"kv_pool.capacity_gb {settings.kv_pool.capacity_gb:g} holds no {block_bytes:,.0f}-byte "
                         f"KV block of {model.name}") from None


def build_pooled_apps(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry], *,
                      time_scale: float) -> tuple[SharedKVPool, list[FastAPI]]:
    """One pool and one mock app per backend (in order), each writing to and loading from that pool.

    Raises:
        ValueError: a bad setting (`pool_num_blocks`, `mock_vllm.app_factory.build_app`).
    """
    pool = SharedKVPool(pool_num_blocks(settings, catalog, backends))
    apps = []
    for backend in backends:
        spec = settings.backend_spec(catalog, backend)
        apps.append(build_app(
            spec.model, spec.hardware, host_tier_gb=backend.host_tier_gb, power_cap_w=backend.power_cap_w,
            tensor_parallel=backend.tensor_parallel, num_gpu_blocks_override=backend.num_gpu_blocks_override,
            time_scale=time_scale, served_model_name=backend.model, pool=pool, pool_link_gb_s=spec.pool_link_gb_s,
        ))
    return pool, apps


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to `serve_all`, which stops every server at once."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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
    try:
        await asyncio.gather(*(serve(server) for server in servers))
    finally:
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


def run_pooled_fleet(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry], *,
                     time_scale: float) -> int:
    """Build the pooled mocks for ``backends`` and serve them until a stop signal (blocks).

    Returns:
        The process exit status (`serve_all`).

    Raises:
        ValueError: a bad setting (`build_pooled_apps`).
    """
    _, apps = build_pooled_apps(settings, catalog, backends, time_scale=time_scale)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve_all(apps, [b.url for b in backends]))
