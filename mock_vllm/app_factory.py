"""Builds a mock vLLM server app for one backend of a fleet config.

The mock takes the same backend entry the gateway routes to (`fleet_config.BackendEntry`):
its router figures come from `fleet_config.Settings.backend_spec` (model, hardware, TP,
power cap, host link, load overlap, pool link), its engine's from `engine_config` (host
tier, KV block override), its P/D settings from `pd_settings` (``kv_role``; its id as its
NIXL engine id; the config's interconnect, whose ``node`` entries place it) and its KV-event
publisher from `kv_events_config` (``kv_events``), so a mock honours every field the gateway
reads, whoever starts
it (``kappa-gateway mock-vllm``, ``mock-fleet``, the simulator, the tests). No files or
environment are read here: a model's tokenizer (``models.<m>.tokenizer``) is loaded by the
command that starts the mock and handed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from fleet_config import BackendEntry, Settings, parse_settings
from fleet_config.settings import ModelEntry
from mock_vllm.engine import MockEngine
from mock_vllm.kv_cache import SharedKVPool
from mock_vllm.kv_event_wire import DEFAULT_ENCODING, Encoding
from mock_vllm.kv_events_config import KvEventsConfig
from mock_vllm.pd import ABORT_REQUEST_TIMEOUT_S, DEFAULT_KV_LOAD_FAILURE_POLICY, PdSettings
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from router.capacity import VLLM_BLOCK_SIZE_TOKENS, kv_block_bytes
from router.profiles import GB, Catalog
from tokenization import EngineTokenizer

STANDALONE_ID = "mock"


def engine_config(backend: BackendEntry, *, max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None) -> EngineConfig:
    """The engine settings of a configured backend: host tier (GB → bytes), KV block override,
    and vLLM's batching limits (``None`` keeps `EngineConfig`'s defaults, 256 and 8192)."""
    limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    return EngineConfig(host_tier_bytes=backend.host_tier_gb * GB, num_gpu_blocks_override=backend.num_gpu_blocks_override,
                        **{k: v for k, v in limits.items() if v is not None})


def pd_settings(settings: Settings, backend: BackendEntry, *,
                kv_load_failure_policy: str = DEFAULT_KV_LOAD_FAILURE_POLICY,
                kv_abort_request_timeout_s: float = ABORT_REQUEST_TIMEOUT_S) -> PdSettings:
    """A configured backend's P/D settings: its id as its engine id, its ``kv_role``, the fleet's links.

    Raises:
        ValueError: an unknown policy or a timeout ≤ 0.
    """
    return PdSettings(engine_id=backend.id, kv_role=backend.kv_role, interconnect=settings.interconnect_table(),
                      kv_load_failure_policy=kv_load_failure_policy,
                      abort_request_timeout_s=kv_abort_request_timeout_s)


def kv_events_config(backend: BackendEntry, *, encoding: Encoding = DEFAULT_ENCODING,
                     python_hash_seed: str | None = None) -> KvEventsConfig | None:
    """The KV-event publisher of a backend entry's ``kv_events`` (``None`` without one): bound on the
    host and port the gateway connects to (so loopback for a local fleet), vLLM's other defaults.

    Args:
        encoding: the events' msgpack form (`mock_vllm.kv_event_wire`).
        python_hash_seed: the ``PYTHONHASHSEED`` the engine's block hashes are seeded by (``None``: unset).
    """
    entry = backend.kv_events
    if entry is None:
        return None
    return KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=entry.endpoint,
                          replay_endpoint=entry.replay_endpoint, topic=entry.topic, encoding=encoding,
                          python_hash_seed=python_hash_seed, bind=True)


def build_backend_app(settings: Settings, backend: BackendEntry, catalog: Catalog, *, time_scale: float = 1.0,
                      kv_pool: SharedKVPool | None = None, registry: CollectorRegistry | None = None,
                      max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                      kv_load_failure_policy: str = DEFAULT_KV_LOAD_FAILURE_POLICY,
                      kv_abort_request_timeout_s: float = ABORT_REQUEST_TIMEOUT_S,
                      kv_events: KvEventsConfig | None = None, tokenizer: EngineTokenizer | None = None) -> FastAPI:
    """A mock vLLM app impersonating ``backend`` of ``settings``.

    Args:
        settings: the validated fleet config ``backend`` belongs to.
        backend: one of ``settings.backends``; it serves ``backend.model`` under that name.
        catalog: the profiles the config names.
        time_scale: wall seconds per engine second, > 0 (0.01 = 100× faster than real time).
        kv_pool: the fleet-shared KV pool this mock writes its prefilled blocks to and loads
            prefix misses from (`shared_kv_pool`); share one object between the apps of one
            process. Needs a ``kv_pool`` section (the pool link comes from it).
        registry: metrics registry; a fresh one when ``None``.
        max_num_seqs, max_num_batched_tokens: vLLM's batching flags.
        kv_load_failure_policy: ``recompute`` or ``fail`` (vLLM's ``kv_load_failure_policy``).
        kv_abort_request_timeout_s: engine seconds a prefill keeps KV for a remote decode
            (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
        kv_events: its KV-event publisher (`kv_events_config` of the entry, or ``--kv-events-config``);
            ``None``: none.
        tokenizer: the tokenizer of ``backend.model`` (its ``models.<m>.tokenizer`` directory,
            loaded by the caller: `tokenization.EngineTokenizer.from_dir`); the mock then tokenises
            as a vLLM engine with that tokenizer would. ``None``: the mock's own tokenizer.

    Raises:
        ValueError: an invalid setting (a pool without a kv_pool section, time_scale ≤ 0, an
            unknown failure policy, or a model whose weights leave no KV memory on this hardware).
    """
    spec = settings.backend_spec(catalog, backend)
    config = engine_config(backend, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    pd = pd_settings(settings, backend, kv_load_failure_policy=kv_load_failure_policy,
                     kv_abort_request_timeout_s=kv_abort_request_timeout_s)
    return create_app(MockEngine(spec, config, kv_pool), served_model_name=backend.model, time_scale=time_scale,
                      registry=registry, pd=pd, kv_events=kv_events, tokenizer=tokenizer)


def shared_kv_pool(settings: Settings, catalog: Catalog, backends: Sequence[BackendEntry]) -> SharedKVPool:
    """The KV pool a config's mocks share: ``kv_pool.capacity_gb`` in blocks of
    `router.capacity.VLLM_BLOCK_SIZE_TOKENS` tokens of the first backend's model.

    Mocks of several models share the pool without hitting each other's blocks (each names
    them within its model's namespace), but it is sized in the first model's blocks.

    Raises:
        ValueError: no kv_pool section, no backends, or a capacity below one block.
    """
    if settings.kv_pool is None or not backends:
        raise ValueError("a shared KV pool needs a kv_pool section and at least one local backend")
    spec = settings.backend_spec(catalog, backends[0])
    block_bytes = kv_block_bytes(spec, VLLM_BLOCK_SIZE_TOKENS)
    try:
        return SharedKVPool.with_capacity(settings.kv_pool.capacity_gb * GB, block_bytes)
    except ValueError:
        raise ValueError(f"kv_pool.capacity_gb {settings.kv_pool.capacity_gb:g} holds no {block_bytes:,.0f}-byte "
                         f"KV block of {spec.model.name}") from None


def standalone_settings(model: str, hardware: str, catalog: Catalog, *, url: str = "http://127.0.0.1:0",
                        served_model_name: str | None = None, **fields: object) -> tuple[Settings, BackendEntry]:
    """A one-backend config for a mock started on its own (``kappa-gateway mock-vllm``, tests).

    Args:
        model, hardware: catalog names.
        url: where it listens (only its form is checked).
        served_model_name: the name clients send (default: ``model``).
        fields: further `BackendEntry` fields (``tensor_parallel``, ``host_tier_gb``,
            ``power_cap_w``, ``host_link_gb_s``, ``overlap_host_load``, ``num_gpu_blocks_override``).

    Raises:
        fleet_config.ConfigError: an unknown model, hardware or field, or a bad value.
    """
    served = served_model_name or model
    doc = {"models": {served: ModelEntry(profile=model).model_dump()},
           "backends": [{"id": STANDALONE_ID, "url": url, "model": served, "hardware": hardware, **fields}]}
    settings = parse_settings(doc, catalog, env={})
    return settings, settings.backends[0]


def idle_metrics_page(model: str, hardware: str, catalog: Catalog) -> str:
    """The ``/metrics`` page of a fresh mock backend of ``model`` on ``hardware`` (an idle engine:
    vLLM's families, every histogram bucket printed), rendered without starting a server.

    Raises:
        fleet_config.ConfigError: an unknown model or hardware.
    """
    settings, entry = standalone_settings(model, hardware, catalog)
    registry = CollectorRegistry()
    build_backend_app(settings, entry, catalog, registry=registry)
    return generate_latest(registry).decode()
