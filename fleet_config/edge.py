"""The gateway's client-facing edge: connection hygiene, admission limits, keys and the access log.

These keys sit flat in the config's ``gateway:`` section (`fleet_config.settings.GatewaySection`
inherits them). Their defaults follow what a trusted proxy does (nginx's ``keepalive_timeout``
75 s, ``client_header_timeout`` and ``client_body_timeout`` 60 s; Envoy's overload manager
answering 503 when a resource is exhausted):

    keep_alive_timeout_s       an idle keep-alive connection is closed after this long. Above the
                               idle time of common client pools (aiohttp 15 s, httpx 5 s,
                               requests/urllib3 unbounded), so the server does not close a
                               connection just as a client reuses it (the ServerDisconnected race
                               seen with uvicorn's default of 5 s).
    client_header_timeout_s    the whole request head must arrive within this long of its first
                               byte (or of the connection's start); else 408 and the connection closes.
    client_body_timeout_s      the longest silence between two reads of a request body; else the
                               connection closes (408 if no answer was started).
    client_send_timeout_s      the longest a response write may stay blocked because the client does
                               not read (nginx ``send_timeout``, 60 s); then the connection is aborted.
    admin_port                 when set, a second listener on this port serves only ``/health``,
                               ``/ready`` and ``/metrics``, outside ``max_client_connections`` (its
                               own small cap): liveness probes are answered while the proxy
                               listener is full. Must differ from ``port``. Default: none.
    max_client_connections     open client connections at most; above it, idle keep-alive
                               connections are closed first (oldest first), then a new connection
                               is answered 503 at once and closed.
    max_header_bytes           request line and headers at most (64 KiB, Envoy's default);
                               above it 431 and the connection closes. Default: half the process's file limit
                               (RLIMIT_NOFILE), leaving the other half to upstream connections.
    max_in_flight_requests     proxy requests admitted at once (read, routed, or relaying);
                               above it: 503 ``service_unavailable_error`` with ``Retry-After``.
    max_in_flight_body_bytes   request-body bytes held at once, over all admitted requests
                               (declared lengths are reserved up front); above it: 503 with
                               ``Retry-After``.
    admin_api_key              when set (or env ``KAPPA_ADMIN_API_KEY``), ``/v1/kappa/*`` needs
                               ``Authorization: Bearer <key>`` (else 401); ``/metrics`` too
                               when ``metrics_require_admin_key``.
    api_keys / api_keys_file   when any is set, the proxy routes need ``Authorization: Bearer <key>``
                               with one of them (the file: one key per line, ``#`` comments);
                               compared in constant time, never logged.
    forward_authorization      the client's ``Authorization`` header goes upstream (default), or
                               is dropped (backends without keys behind a gateway that has them).
    access_log / access_log_format
                               one line per request at INFO on logger ``kappa_gateway.access``:
                               ``text`` (key=value) or ``json``.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

# Seconds; nginx's defaults (ngx_http_core_module: keepalive_timeout 75s, client_header_timeout 60s,
# client_body_timeout 60s).
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 75.0
DEFAULT_CLIENT_HEADER_TIMEOUT_S = 60.0
DEFAULT_CLIENT_BODY_TIMEOUT_S = 60.0
DEFAULT_CLIENT_SEND_TIMEOUT_S = 60.0  # nginx send_timeout
DEFAULT_MAX_IN_FLIGHT_REQUESTS = 4096
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line + headers: Envoy's max_request_headers_kb default (60 KiB)
# 256 MiB: 8 bodies at the 32 MiB limit. A body costs ~3-4x its size at its peak (bench/body_memory.py:
# the buffer, its parsed form, the canonical prompt), so this bounds body memory near 1 GiB.
DEFAULT_MAX_IN_FLIGHT_BODY_BYTES = 256 * 1024 * 1024


def default_max_client_connections() -> int:
    """Half the soft ``RLIMIT_NOFILE`` (at least 64): the other half stays for upstream
    connections, Redis and files, so health checks and new requests still get sockets."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft // 2)


class EdgeSettings(BaseModel):
    """The edge keys of ``gateway:`` (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_alive_timeout_s: float = Field(default=DEFAULT_KEEP_ALIVE_TIMEOUT_S, gt=0)
    client_header_timeout_s: float = Field(default=DEFAULT_CLIENT_HEADER_TIMEOUT_S, gt=0)
    client_body_timeout_s: float = Field(default=DEFAULT_CLIENT_BODY_TIMEOUT_S, gt=0)
    client_send_timeout_s: float = Field(default=DEFAULT_CLIENT_SEND_TIMEOUT_S, gt=0)
    admin_port: int | None = Field(default=None, ge=1, le=65535)
    max_client_connections: int = Field(default_factory=default_max_client_connections, gt=0)
    max_header_bytes: int = Field(default=DEFAULT_MAX_HEADER_BYTES, ge=1024)
    max_in_flight_requests: int = Field(default=DEFAULT_MAX_IN_FLIGHT_REQUESTS, gt=0)
    max_in_flight_body_bytes: int = Field(default=DEFAULT_MAX_IN_FLIGHT_BODY_BYTES, gt=0)
    admin_api_key: SecretStr | None = None
    metrics_require_admin_key: bool = False
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_file: Path | None = None
    forward_authorization: bool = True
    access_log: bool = True
    access_log_format: Literal["text", "json"] = "text"

    @field_validator("admin_api_key")
    @classmethod
    def _non_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be empty (omit it to leave the admin routes open)")
        return value

    @model_validator(mode="after")
    def _metrics_key_needs_a_key(self) -> EdgeSettings:
        if self.metrics_require_admin_key and self.admin_api_key is None:
            raise ValueError("metrics_require_admin_key needs admin_api_key (or KAPPA_ADMIN_API_KEY): "
                             "without one /metrics would stay open")
        return self

    @model_validator(mode="after")
    def _admin_port_apart(self) -> EdgeSettings:
        if self.admin_port is not None and self.admin_port == getattr(self, "port", None):
            raise ValueError(f"admin_port ({self.admin_port}) must differ from port: it is a listener of its own")
        return self

    @model_validator(mode="after")
    def _one_body_fits(self) -> EdgeSettings:
        limit = getattr(self, "max_body_bytes", 0)
        if self.max_in_flight_body_bytes < limit:
            raise ValueError(f"max_in_flight_body_bytes ({self.max_in_flight_body_bytes}) must be at least "
                             f"max_body_bytes ({limit}): a body under the limit could never be admitted")
        return self

    def client_api_keys(self) -> list[bytes]:
        """The proxy routes' keys: ``api_keys`` plus the lines of ``api_keys_file``, as bytes.

        Raises:
            OSError: the file cannot be read (at start-up, so a bad path fails loudly).
        """
        keys = [k.get_secret_value().encode() for k in self.api_keys]
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line.encode())
        return keys
