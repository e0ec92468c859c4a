"""``kappa-gateway mock-vllm`` and ``mock-fleet``: vLLM-compatible mock backends.

``mock-vllm`` serves one mock, either a backend of a fleet config (``--config FILE
--backend ID``, every field of that entry honoured) or one described by flags;
``mock-fleet`` serves every local backend of a config (`gateway.commands.fleet`), through
the hidden ``mock-fleet-worker``. All three build the mock with
`mock_vllm.app_factory.build_backend_app` from a config entry.

KV-cache events (`mock_vllm.kv_events`): ``mock-vllm --kv-events-config JSON`` takes vLLM's flag;
with ``--config`` and no such flag, and under ``mock-fleet``, a backend entry's ``kv_events``
starts its publisher, bound where the gateway connects. The engines' block hashes are seeded by
this process's ``PYTHONHASHSEED``, as vLLM's are.

Tokenizers: a mock uses the tokenizer its model's ``models`` entry names (``mock-vllm --tokenizer DIR``
for one started by flags; `gateway.commands.tokenizers`).
"""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import typer

from fleet_config import BackendEntry, ConfigError, Settings, default_catalog
from gateway.commands.typer_app import app, load_config

if TYPE_CHECKING:
    from fleet_config import BackendEntry
    from mock_vllm.kv_events_config import KvEventsConfig

# uvicorn waits forever for open streams by default (STYLE.md B7); a mock stream is cut after this.
MOCK_VLLM_GRACEFUL_SHUTDOWN_S = 5.0
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8001
# P/D (mock_vllm.pd): vLLM's kv_load_failure_policy default and VLLM_NIXL_ABORT_REQUEST_TIMEOUT's.
KV_LOAD_FAILURE_POLICY_DEFAULT, KV_ABORT_REQUEST_TIMEOUT_S_DEFAULT = "fail", 480.0
KvLoadFailurePolicy = Annotated[str, typer.Option(
    "--kv-load-failure-policy", help="P/D: a failed KV pull 'recompute's the prompt locally or 'fail's the request "
    "(vLLM's kv_load_failure_policy)")]
KvAbortTimeout = Annotated[float, typer.Option(
    "--kv-abort-request-timeout-s", min=0.001, help="P/D: modelled seconds a prefill keeps KV for a remote decode "
    "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")]


class EventEncoding(str, Enum):
    """The msgpack form of KV events (`mock_vllm.kv_event_wire`): current vLLM's maps, or older positional arrays."""

    map = "map"
    positional = "positional"


KvEventsEncoding = Annotated[EventEncoding, typer.Option(
    "--kv-events-encoding", help="KV events as tagged maps (current vLLM) or positional arrays (vLLM before #42892)")]


def _kv_events(json_text: str | None, entry: BackendEntry, encoding: EventEncoding) -> KvEventsConfig | None:
    """The publisher config: ``--kv-events-config`` if given, else the backend entry's ``kv_events`` (or None).
    Raises ValueError on a bad JSON document or value."""
    from mock_vllm.app_factory import kv_events_config
    from mock_vllm.kv_events_config import KvEventsConfig

    seed = os.environ.get("PYTHONHASHSEED")  # vLLM seeds NONE_HASH with it when set
    if json_text is not None:
        return KvEventsConfig.from_json(json_text, encoding=encoding.value, python_hash_seed=seed)
    return kv_events_config(entry, encoding=encoding.value, python_hash_seed=seed)


TokenizerOption = Annotated[str | None, typer.Option(
    "--tokenizer", help="the model's tokenizer directory (tokenizer.json, tokenizer_config.json): prompts are "
    "tokenised as vLLM would (default: the config's models.<m>.tokenizer, else the mock's own)")]
KvEventsConfigOption = Annotated[str | None, typer.Option(
    "--kv-events-config", help="vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, "
    "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
    "(default: the backend's kv_events with --config)")]
KvRoleOption = Annotated[str | None, typer.Option(
    "--kv-role", help="P/D role: prefill, decode or both (default: the backend's kv_role with --config, else both)")]


@app.command("mock-vllm")
def mock_vllm(
    model: Annotated[str, typer.Option("--model", "-m", help="catalog model name")] = "llama-3.1-8b",
    hardware: Annotated[str, typer.Option("--hardware", "-w", help="catalog hardware name")] = "h100-sxm",
    host_tier_gb: Annotated[float, typer.Option("--host-tier-gb", min=0, help="CPU KV offload tier, GB (0: none)")] = 0.0,
    port: Annotated[int | None, typer.Option("--port", min=0, max=65535,
                                             help="default: the backend's URL with --config, else 8001")] = None,
    host: Annotated[str | None, typer.Option(
        "--host", help="default: the backend's URL host with --config, else 127.0.0.1")] = None,
    time_scale: Annotated[float, typer.Option(
        "--time-scale", help="wall seconds per modelled second, > 0 (0.01 = 100x faster)")] = 1.0,
    power_cap_w: Annotated[float | None, typer.Option("--power-cap-w", help="board power cap, W")] = None,
    tensor_parallel: Annotated[int, typer.Option("--tensor-parallel", min=1, help="GPUs in the TP group")] = 1,
    host_link_gb_s: Annotated[float | None, typer.Option(
        "--host-link-gb-s", help="measured sustained host→HBM bandwidth of the TP group, GB/s")] = None,
    overlap_host_load: Annotated[bool, typer.Option(
        "--overlap-host-load/--no-overlap-host-load", help="KV loads overlap compute (LMCache-style) or precede it")] = True,
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs", min=1, help="vLLM --max-num-seqs (default 256)")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        "--max-num-batched-tokens", min=1, help="vLLM --max-num-batched-tokens (default 8192)")] = None,
    num_gpu_blocks_override: Annotated[int | None, typer.Option(
        "--num-gpu-blocks-override", min=1, help="vLLM --num-gpu-blocks-override: KV blocks instead of what HBM allows")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="model name clients send (default: the catalog name)")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="serve a backend of this fleet config instead (with --backend)")] = None,
    backend_id: Annotated[str | None, typer.Option("--backend", help="the backend id in --config to impersonate")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level; 'warning' drops access logs")] = "info",
    kv_role: KvRoleOption = None,
    tokenizer: TokenizerOption = None,
    kv_load_failure_policy: KvLoadFailurePolicy = KV_LOAD_FAILURE_POLICY_DEFAULT,
    kv_abort_request_timeout_s: KvAbortTimeout = KV_ABORT_REQUEST_TIMEOUT_S_DEFAULT,
    kv_events_config: KvEventsConfigOption = None,
    kv_events_encoding: KvEventsEncoding = EventEncoding.map,
) -> None:
    """Serve a vLLM-compatible mock backend whose timing models MODEL on HARDWARE (or a config's backend)."""
    import uvicorn

    from gateway.commands.tokenizers import backend_tokenizer
    from mock_vllm.app_factory import build_backend_app, standalone_settings

    catalog = default_catalog()
    try:
        if config is not None or backend_id is not None:
            settings, entry, host, port = _config_backend(config, backend_id, host, port, kv_role)
        else:
            host, port = host or DEFAULT_HOST, DEFAULT_PORT if port is None else port
            settings, entry = standalone_settings(
                model, hardware, catalog, url=f"http://{host}:{port}", served_model_name=served_model_name,
                host_tier_gb=host_tier_gb, power_cap_w=power_cap_w, tensor_parallel=tensor_parallel,
                host_link_gb_s=host_link_gb_s, overlap_host_load=overlap_host_load,
                num_gpu_blocks_override=num_gpu_blocks_override, kv_role=kv_role or "both")
        tok = backend_tokenizer(settings, entry, override=tokenizer, config_dir=config.parent if config else None)
        app_ = build_backend_app(settings, entry, catalog, time_scale=time_scale, max_num_seqs=max_num_seqs, tokenizer=tok,
                                 max_num_batched_tokens=max_num_batched_tokens, kv_load_failure_policy=kv_load_failure_policy,
                                 kv_abort_request_timeout_s=kv_abort_request_timeout_s,
                                 kv_events=_kv_events(kv_events_config, entry, kv_events_encoding))
    except ValueError as exc:  # ConfigError (unknown model/hardware, bad value), a tokenizer, an engine that cannot fit
        raise typer.BadParameter(str(exc)) from exc
    uvicorn.run(app_, host=host, port=port, timeout_graceful_shutdown=MOCK_VLLM_GRACEFUL_SHUTDOWN_S,
                log_level=log_level, access_log=log_level in ("debug", "trace", "info"))


def _config_backend(config: Path | None, backend_id: str | None, host: str | None, port: int | None,
                    kv_role: str | None) -> tuple[Settings, BackendEntry, str | None, int]:
    """``--config``'s backend ``--backend`` (its kv_role overridden by ``--kv-role``), and where it listens."""
    if config is None or backend_id is None:
        raise typer.BadParameter("--config and --backend go together")
    settings = load_config(config)
    entry = next((b for b in settings.backends if b.id == backend_id), None)
    if entry is None:
        raise typer.BadParameter(f"no backend {backend_id!r} in {config}", param_hint="--backend")
    entry = entry if kv_role is None else entry.model_copy(update={"kv_role": kv_role})
    return settings, entry, host or urlsplit(entry.url).hostname, entry.port if port is None else port


@app.command("mock-fleet")
def mock_fleet_cmd(
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config YAML")] = Path("config/fleet.local.yaml"),
    time_scale: Annotated[float, typer.Option("--time-scale", help="wall seconds per modelled second (0.01 = 100x faster)")] = 1.0,
    kv_load_failure_policy: KvLoadFailurePolicy = KV_LOAD_FAILURE_POLICY_DEFAULT,
    kv_abort_request_timeout_s: KvAbortTimeout = KV_ABORT_REQUEST_TIMEOUT_S_DEFAULT,
    kv_events_encoding: KvEventsEncoding = EventEncoding.map,
) -> None:
    """Start a mock vLLM backend for every local backend in the config; Ctrl-C stops them all.

    With a kv_pool section, one process serves every mock, all on one shared KV pool. Each mock
    takes its backend's kv_role and the config's interconnect (P/D: vLLM's NixlConnector protocol).
    """
    import signal
    import sys
    import time

    from gateway.commands.fleet import mock_fleet, worker_settings_doc

    settings = load_config(config)
    pd_flags = ["--kv-load-failure-policy", kv_load_failure_policy,
                "--kv-abort-request-timeout-s", str(kv_abort_request_timeout_s),
                "--kv-events-encoding", kv_events_encoding.value]
    try:
        worker_settings_doc(settings, config.parent)  # a missing tokenizer directory: an error before any start
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    with mock_fleet(settings, time_scale=time_scale, quiet=False, worker_flags=pd_flags,
                    config_dir=config.parent) as mocks:
        for mock in mocks:
            if settings.kv_pool is not None:
                typer.echo(f"one process (pid {mock.proc.pid}) serving {len(mock.backends)} mocks that share a "
                           f"{settings.kv_pool.capacity_gb:g} GB KV pool:")
            for backend in mock.backends:
                role = "" if backend.kv_role == "both" else f", {backend.kv_role}"
                typer.echo(f"{backend.id}: {backend.hardware} x{backend.tensor_parallel} at {backend.url} "
                           f"(pid {mock.proc.pid}{role})")
        typer.echo("mock fleet up; Ctrl-C to stop")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's `&` job starts with SIGINT ignored
        running = list(mocks)
        try:
            while running:  # one mock dying (say, kill -9 in a fault drill) leaves the others serving
                time.sleep(0.5)  # supervising: wake to notice a child that died
                for mock in [m for m in running if m.proc.poll() is not None]:
                    running.remove(mock)
                    ids = ", ".join(b.id for b in mock.backends)
                    typer.echo(f"mock {ids} (pid {mock.proc.pid}) exited with {mock.proc.returncode}; "
                               f"{len(running)} process(es) still serving", err=True)
        except KeyboardInterrupt:
            return
    raise typer.Exit(1)  # every mock died on its own


@app.command("mock-fleet-worker", hidden=True)
def mock_fleet_worker(
    config: Annotated[Path, typer.Option("--config", "-c", help="fleet config YAML")],
    backend_ids: Annotated[list[str], typer.Option("--backend", help="a backend id of CONFIG to serve (repeatable)")],
    time_scale: Annotated[float, typer.Option("--time-scale", help="wall seconds per modelled second")] = 1.0,
    kv_load_failure_policy: KvLoadFailurePolicy = KV_LOAD_FAILURE_POLICY_DEFAULT,
    kv_abort_request_timeout_s: KvAbortTimeout = KV_ABORT_REQUEST_TIMEOUT_S_DEFAULT,
    kv_events_encoding: KvEventsEncoding = EventEncoding.map,
) -> None:
    """Serve the given backends of CONFIG in this one process (on one shared KV pool if it has one)."""
    from gateway.commands.fleet_worker import run_fleet
    from gateway.commands.tokenizers import model_tokenizers

    settings = load_config(config, overrides=False)  # as mock-fleet resolved it: no overrides again
    by_id = {b.id: b for b in settings.backends}
    unknown = [b for b in backend_ids if b not in by_id]
    if unknown:
        typer.echo(f"error: {config}: no backend {unknown[0]!r}", err=True)
        raise typer.Exit(2)
    try:
        backends = [by_id[b] for b in backend_ids]
        status = run_fleet(settings, default_catalog(), backends, time_scale=time_scale,
                           tokenizers=model_tokenizers(settings, backends, config.parent),
                           kv_load_failure_policy=kv_load_failure_policy,
                           kv_abort_request_timeout_s=kv_abort_request_timeout_s,
                           kv_events_encoding=kv_events_encoding.value,
                           python_hash_seed=os.environ.get("PYTHONHASHSEED"))
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {config}: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(status)
