"""The deployment config: one schema, read by the gateway, the simulator and the mock backends.

The one reader of the config YAML file and of the ``KAPPA_*`` environment, when `load_settings`
or `parse_settings` is called (never at import).

One file per deployment (``config/fleet.local.yaml`` is the example)::

    gateway:  {host, port, max_body_bytes, timeouts, health and scrape intervals, health-check
               thresholds, panic threshold}
    outlier_detection: {consecutive_5xx, base_ejection_time_s, max_ejection_percent, ...}
                                                              (optional: `fleet_config.outlier`)
    index:    {backend: memory|redis, redis_url, key_prefix, timeout_s, key_ttl_s, breaker_failures,
               breaker_open_s, breaker_max_open_s, block_size_tokens, bytes_per_token, share_load,
               load_sync_interval_s}
    routing:  {policy: kappa|round-robin|least-loaded|prefix-affinity|weighted, params: {...}, seed,
               measured_figures: {enabled, prior_requests, time_constant_s, deviation_ratio}}
    models:   {served name: {profile: catalog name, tokenizer: dir}}  (optional; default: catalog names)
    kv_pool:  {capacity_gb, link_gb_s_per_gpu}                (optional: a KV store the fleet shares)
    backends: [{id, url, model, hardware, power_cap_w, tensor_parallel, host_tier_gb,
                host_link_gb_s, kv_pool_link_gb_s, overlap_host_load, num_gpu_blocks_override, labels,
                kv_role, node, kv_events: {endpoint, replay_endpoint, topic}}]

Parsing is strict: an unknown key or a bad value fails at start-up with its path
(``backends[2].hardware: unknown hardware 'h300'``), never a silent default (STYLE.md B7).
Environment variables override the deployment settings only: ``KAPPA_HOST``, ``KAPPA_PORT``,
``KAPPA_REDIS_URL`` (which also switches the index to Redis), ``KAPPA_ADMIN_API_KEY``.

Defaults are defined once: the index's in `prefix_index`, imported by `fleet_config.sections` (the
index, routing and KV-pool sections); the gateway's own here and in `fleet_config.edge` and
`fleet_config.outlier` (``DEFAULT_*``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from fleet_config.edge import EdgeSettings
from fleet_config.errors import ConfigError
from fleet_config.interconnect import InterconnectSection, KvRole
from fleet_config.kv_events import KvEventsEntry, resolve_tokenizer_dir
from fleet_config.sections import (
    IndexSection,
    KvPoolSection,
    RoutingSection,
    StrictSection,
)
from fleet_config.outlier import (
    DEFAULT_HEALTHY_PANIC_THRESHOLD_PERCENT,
    DEFAULT_HEALTHY_THRESHOLD,
    DEFAULT_UNHEALTHY_THRESHOLD,
    OutlierDetectionSection,
)
from router.cost import BackendSpec, kv_pool_link_gb_s
from router.links import NO_INTERCONNECT, Interconnect
from router.policies import POLICY_NAMES
from router.profiles import Catalog, ModelProfile

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # 32 MiB: a 128k-token prompt is ~0.5 MB of text; images are larger


RetryCondition = Literal["connect-failure", "reset", "5xx", "timeout"]
# Envoy's retry buffer default is 1 MiB; an LLM prompt of 128k tokens is ~0.5 MB of text, so
# 4 MiB re-sends every text prompt and refuses to re-send large image payloads.
DEFAULT_RETRY_MAX_BODY_BYTES = 4 * 1024 * 1024


class RetrySection(StrictSection):
    """What the gateway retries on another backend, before the first byte only (never after).

    Attributes:
        retry_on: the failures retried (Envoy's ``retry_on`` vocabulary): ``connect-failure``
            (refused, or no connection within the connect timeout), ``reset`` (the connection
            closed or reset before the first byte), ``5xx`` (a 5xx status before anything was
            relayed), ``timeout`` (no first byte within the per-try timeout, stream headers not
            within the idle timeout, or the backend failed its health check while the request
            waited). A timed-out backend may have done the work, so ``timeout`` is off by default.
        max_retries: extra attempts, each on another backend (0: never retry).
        max_body_bytes: a body larger than this is never re-sent.
    """

    retry_on: list[RetryCondition] = Field(default_factory=lambda: ["connect-failure", "reset", "5xx"])
    max_retries: int = Field(default=1, ge=0)
    max_body_bytes: int = Field(default=DEFAULT_RETRY_MAX_BODY_BYTES, ge=0)


class GatewaySection(EdgeSettings):
    """Listener, limits, timeouts (seconds), retries and shutdown; the client-facing edge keys
    (connections, admission limits, keys, access log) are `fleet_config.edge.EdgeSettings`'.

    Timeouts, from the client's side of a request (each is documented in the README):
        upstream_connect_timeout_s: TCP connect to a backend.
        upstream_first_byte_timeout_s: ONE deadline from receipt to the first body byte, over
            every attempt (a retry does not get a fresh budget): queueing and prefill.
        upstream_per_try_timeout_s: optional cap per attempt within that deadline.
        upstream_idle_timeout_s: once a response has begun, the longest silence between two
            upstream reads (stream and non-stream); for a streamed request also the wait for
            the response headers, which vLLM sends at once (before the prefill).
        (``outlier_ejection_s`` is gone: ejections follow ``outlier_detection:``,
        `fleet_config.outlier`; a config that still sets it fails with a message naming the keys.)
        shutdown_drain_delay_s: after SIGTERM, ``/ready`` answers 503 this long before the
            listener closes (so a load balancer stops sending first).
        graceful_shutdown_timeout_s: then, how long requests in flight may finish; streams
            still open get an SSE error event and ``[DONE]``.

    Health (Envoy's ``HealthCheck`` and ``CommonLbConfig`` names, `fleet_config.outlier`):
        unhealthy_threshold: failed ``/health`` checks in a row that take a backend out of rotation.
        healthy_threshold: passed checks in a row that bring it back (its first ever: one).
        healthy_panic_threshold_percent: when fewer than this % of a model's backends are in
            rotation, its requests go to all of them that ever passed a check (panic mode).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_first_byte_timeout_s: float = Field(default=600.0, gt=0)
    upstream_per_try_timeout_s: float | None = Field(default=None, gt=0)
    upstream_idle_timeout_s: float = Field(default=30.0, gt=0)
    retry: RetrySection = Field(default_factory=RetrySection)
    shutdown_drain_delay_s: float = Field(default=5.0, ge=0)
    graceful_shutdown_timeout_s: float = Field(default=30.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    unhealthy_threshold: int = Field(default=DEFAULT_UNHEALTHY_THRESHOLD, ge=1)
    healthy_threshold: int = Field(default=DEFAULT_HEALTHY_THRESHOLD, ge=1)
    healthy_panic_threshold_percent: float = Field(default=DEFAULT_HEALTHY_PANIC_THRESHOLD_PERCENT, ge=0, le=100)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    max_connections_per_backend: int = Field(default=1024, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _outlier_ejection_s_moved(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "outlier_ejection_s" in data:
            raise ValueError("outlier_ejection_s was replaced by the outlier_detection: section (Envoy's outlier "
                             "detection): set outlier_detection.base_ejection_time_s (the first ejection's length, "
                             "growing with repeats up to max_ejection_time_s) and consecutive_5xx (failures in a "
                             "row before one)")
        return data


class ModelEntry(StrictSection):
    """A served model: its catalog profile and, optionally, the tokenizer its engines use
    (a directory with ``tokenizer.json`` and ``tokenizer_config.json``; `fleet_config.kv_events`)."""

    profile: str
    tokenizer: str | None = Field(default=None, min_length=1)


class BackendEntry(StrictSection):
    """One backend: where it is, what it serves, on what hardware."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    url: str
    model: str
    hardware: str
    power_cap_w: float | None = Field(default=None, gt=0)
    tensor_parallel: int = Field(default=1, ge=1)
    host_tier_gb: float = Field(default=0.0, ge=0)
    host_link_gb_s: float | None = Field(default=None, gt=0)
    # Sustained pool -> HBM bandwidth of the whole TP group, GB/s; only with a kv_pool section.
    kv_pool_link_gb_s: float | None = Field(default=None, gt=0)
    overlap_host_load: bool = True
    # vLLM --num-gpu-blocks-override (16-token blocks): a KV cache smaller than HBM allows.
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    labels: dict[str, str] = Field(default_factory=dict)
    # P/D (`fleet_config.interconnect`): its role, and the node it shares NVLink with others on.
    kv_role: KvRole = "both"
    node: str | None = Field(default=None, min_length=1)
    # Issue 30: where the engine publishes its KV-cache events (`fleet_config.kv_events`).
    kv_events: KvEventsEntry | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"must be http(s)://host:port, got {value!r}")
        return value.rstrip("/")

    @property
    def port(self) -> int:
        return urlsplit(self.url).port  # validated present


class Settings(StrictSection):
    """The whole validated config, plus the catalog it was checked against."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    gateway: GatewaySection = Field(default_factory=GatewaySection)
    index: IndexSection = Field(default_factory=IndexSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    models: dict[str, ModelEntry] = Field(default_factory=dict)
    kv_pool: KvPoolSection | None = None
    outlier_detection: OutlierDetectionSection = Field(default_factory=OutlierDetectionSection)
    interconnect: InterconnectSection | None = None
    backends: list[BackendEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _kv_pool_link_needs_kv_pool(self) -> Settings:
        for i, b in enumerate(self.backends):
            if b.kv_pool_link_gb_s is not None and self.kv_pool is None:
                raise ValueError(f"backends[{i}].kv_pool_link_gb_s is set but there is no kv_pool section")
        return self

    def interconnect_table(self) -> Interconnect:
        """The router's link table (`router.links.Interconnect`; empty without an ``interconnect:``)."""
        if self.interconnect is None:
            return NO_INTERCONNECT
        return self.interconnect.table({b.id: b.node for b in self.backends if b.node is not None})

    @property
    def disaggregated(self) -> bool:
        """Whether requests may be split (P/D): some backend prefills for others and a link exists."""
        return self.interconnect is not None and any(b.kv_role != "both" for b in self.backends)

    def model_profile(self, catalog: Catalog, served_name: str) -> ModelProfile:
        """The catalog profile behind a served model name."""
        entry = self.models.get(served_name)
        return catalog.model(entry.profile if entry else served_name)

    def backend_spec(self, catalog: Catalog, backend: BackendEntry) -> BackendSpec:
        """The router's static figures for one backend (its pool link derived as `KvPoolSection` says)."""
        hardware = catalog.hw(backend.hardware)
        pool_link = None
        if self.kv_pool is not None:
            pool_link = backend.kv_pool_link_gb_s or kv_pool_link_gb_s(
                hardware, backend.tensor_parallel, link_gb_s_per_gpu=self.kv_pool.link_gb_s_per_gpu,
                host_link_gb_s=backend.host_link_gb_s)
        return _interned(BackendSpec(
            model=self.model_profile(catalog, backend.model),
            hardware=hardware,
            power_cap_w=backend.power_cap_w,
            tensor_parallel=backend.tensor_parallel,
            host_link_gb_s=backend.host_link_gb_s,
            overlap_host_load=backend.overlap_host_load,
            kv_pool_link_gb_s=pool_link,
        ))

    def served_models(self) -> list[str]:
        """Model names clients may ask for, in config order, without repeats."""
        return list(dict.fromkeys(b.model for b in self.backends))


@functools.cache
def _interned(spec: BackendSpec) -> BackendSpec:
    """The first spec equal to ``spec``: backends configured alike share one `BackendSpec` object,
    which the router keys its per-request predictions on (`router.candidates.build_candidates`)."""
    return spec


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: Any) -> str:
    if error["type"] == "invalid_key" and isinstance(error.get("input"), bool):
        # YAML 1.1 reads a bare on/off/yes/no key as a boolean (`retry: {on: ...}`).
        return f"a key read as {error['input']}: a bare on/off/yes/no key is a boolean in YAML (quote it)"
    return error["msg"]


def parse_settings(doc: Mapping[str, Any], catalog: Catalog, env: Mapping[str, str] | None = None) -> Settings:
    """Validate a parsed config against the catalog, applying environment overrides.

    Raises:
        ConfigError: the first problem, prefixed with the path of the bad key.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError("config: the file must hold a mapping (gateway, index, routing, models, backends)")
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in doc.items()}
    env = os.environ if env is None else env
    gateway = data.setdefault("gateway", {})
    index = data.setdefault("index", {})
    if isinstance(gateway, dict):
        if env.get("KAPPA_HOST"):
            gateway["host"] = env["KAPPA_HOST"]
        if env.get("KAPPA_PORT"):
            gateway["port"] = env["KAPPA_PORT"]
        if "KAPPA_ADMIN_API_KEY" in env:  # set but empty is an error (a secret that failed to render), not "open"
            gateway["admin_api_key"] = env["KAPPA_ADMIN_API_KEY"]
    if isinstance(index, dict) and env.get("KAPPA_REDIS_URL"):
        index.update(backend="redis", redis_url=env["KAPPA_REDIS_URL"])
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        # An unknown key first: a misspelt required key is also reported missing, and the
        # spelling is the news. At most three problems, each with its path.
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[:3]
        raise ConfigError("; ".join(f"{_path(e['loc'][:-1] if e['type'] == 'invalid_key' else e['loc']) or 'config'}: "
                                    f"{_message(e)}" for e in errors)) from exc
    _check_against_catalog(settings, catalog)
    try:
        settings.gateway.client_api_keys()
    except OSError as exc:
        raise ConfigError(f"gateway.api_keys_file: cannot read {settings.gateway.api_keys_file}: {exc.strerror}") from exc
    return settings


def _check_against_catalog(settings: Settings, catalog: Catalog) -> None:
    for name, entry in settings.models.items():
        if entry.profile not in catalog.models:
            raise ConfigError(f"models.{name}.profile: unknown model profile {entry.profile!r}")
    seen_ids: set[str] = set()
    seen_urls: set[str] = set()
    for i, backend in enumerate(settings.backends):
        where = f"backends[{i}]"
        if backend.id in seen_ids:
            raise ConfigError(f"{where}.id: duplicate backend id {backend.id!r}")
        if backend.url in seen_urls:
            raise ConfigError(f"{where}.url: {backend.url} is used by another backend")
        seen_ids.add(backend.id)
        seen_urls.add(backend.url)
        if backend.model not in settings.models and backend.model not in catalog.models:
            raise ConfigError(f"{where}.model: {backend.model!r} is neither in models: nor a catalog model")
        if backend.hardware not in catalog.hardware:
            raise ConfigError(f"{where}.hardware: unknown hardware {backend.hardware!r} "
                              f"(known: {', '.join(sorted(catalog.hardware))})")
        try:
            settings.backend_spec(catalog, backend)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    _check_interconnect(settings, seen_ids)


def _check_interconnect(settings: Settings, ids: set[str]) -> None:
    """P/D: every link names known backends; every ``prefill`` backend has a decoder of its model to
    link to (else nothing it prefills could be decoded)."""
    section = settings.interconnect
    if section is not None:
        for i, entry in enumerate(section.links):
            for name in entry.between:
                if name not in ids:
                    raise ConfigError(f"interconnect.links[{i}].between: unknown backend id {name!r}")
    table = settings.interconnect_table()
    for i, backend in enumerate(settings.backends):
        if backend.kv_role != "prefill":
            continue
        decoders = [d.id for d in settings.backends
                    if d.kv_role != "prefill" and d.model == backend.model and table.link(backend.id, d.id)]
        if not decoders:
            raise ConfigError(f"backends[{i}].kv_role: {backend.id!r} prefills, but no backend that decodes "
                              f"{backend.model!r} has a link from it (add an interconnect: section, or a link)")


def load_settings(path: Path, catalog: Catalog, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate a config file. Raises ConfigError (also for unreadable or non-YAML files)."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return _with_tokenizer_paths(parse_settings(doc or {}, catalog, env), Path(path).parent)


def _with_tokenizer_paths(settings: Settings, config_dir: Path) -> Settings:
    """``settings`` with each ``models.<m>.tokenizer`` made absolute: a relative one is taken from the
    config file's directory, then the working directory (`fleet_config.kv_events.resolve_tokenizer_dir`).

    Raises:
        ConfigError: a tokenizer directory without a ``tokenizer.json``, named by its key.
    """
    models = dict(settings.models)
    for name, entry in settings.models.items():
        if entry.tokenizer is not None:
            try:
                resolved = resolve_tokenizer_dir(entry.tokenizer, config_dir)
            except ValueError as exc:
                raise ConfigError(f"models.{name}.tokenizer: {exc}") from None
            models[name] = entry.model_copy(update={"tokenizer": str(resolved)})
    return settings if models == settings.models else settings.model_copy(update={"models": models})


__all__ = ["POLICY_NAMES", "BackendEntry", "Settings", "load_settings", "parse_settings"]
