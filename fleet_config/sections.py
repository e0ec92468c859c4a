"""The config's sections for the prefix index, the routing policy and the KV pool (`fleet_config.settings`
assembles them with the gateway's, the models' and the backends').

Strict like every section: an unknown key or a bad value is an error naming its path. Defaults are
defined once: the index's in `prefix_index` (`prefix_index.redis_defaults`, the breaker's, the block
size), imported here; the replicas' sync interval and the pool link here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefix_index.breaker import DEFAULT_FAILURE_THRESHOLD, DEFAULT_MAX_OPEN_S, DEFAULT_OPEN_S
from prefix_index.hashing import BYTES_PER_TOKEN_ESTIMATE, DEFAULT_BLOCK_SIZE_TOKENS
from prefix_index.redis_defaults import DEFAULT_KEY_PREFIX, DEFAULT_KEY_TTL_S, DEFAULT_TIMEOUT_S
from router.link_factors import (
    DEFAULT_DEVIATION_RATIO,
    DEFAULT_PRIOR_REQUESTS,
    DEFAULT_TIME_CONSTANT_S,
    MeasurementSettings,
)
from router.policies import PolicyConfigError, build_policy

# Seconds between a gateway replica's periodic load exchanges (gateway.replicas.peer_load): its
# lease (20 intervals, 1 s) and its stretched period while decisions read (5 intervals, 250 ms)
# are multiples of it; 50 ms keeps what a joining replica first reads within 50 ms of current at
# 20 small Lua calls a second per replica. Decisions read the others' figures on their own clock.
DEFAULT_LOAD_SYNC_INTERVAL_S = 0.05


class StrictSection(BaseModel):
    """A config section: frozen, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class IndexSection(StrictSection):
    """The prefix index: embedded (``memory``) or shared (``redis``).

    Redis only (README "Redis index"): ``timeout_s`` bounds a match or record (event-loop
    stalls excluded, `prefix_index.deadline`); ``key_ttl_s`` is every key's expiry, refreshed
    when written; the circuit breaker (`prefix_index.breaker`) opens after
    ``breaker_failures`` consecutive failed matches, skips the index ``breaker_open_s``,
    then probes once, doubling the wait after each failed probe up to ``breaker_max_open_s``.
    ``redis_url``'s scheme says what kind of Redis it is (`prefix_index.redis_connect`):
    ``redis://``/``rediss://``/``unix://`` one server, ``redis+cluster://h:p,h:p`` a Redis
    Cluster, ``redis+sentinel://h:26379,h:26379/service[/db]`` the master a Sentinel set names.
    """

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    key_ttl_s: int = Field(default=DEFAULT_KEY_TTL_S, ge=1)
    breaker_failures: int = Field(default=DEFAULT_FAILURE_THRESHOLD, ge=1)
    breaker_open_s: float = Field(default=DEFAULT_OPEN_S, gt=0)
    breaker_max_open_s: float = Field(default=DEFAULT_MAX_OPEN_S, gt=0)
    block_size_tokens: int = Field(default=DEFAULT_BLOCK_SIZE_TOKENS, gt=0)
    bytes_per_token: float = Field(default=BYTES_PER_TOKEN_ESTIMATE, gt=0)
    # With redis: gateway replicas exchange their load through it every this many seconds and
    # record a request's chain when it is sent (gateway.replicas.peer_load); false: each replica alone.
    share_load: bool = True
    load_sync_interval_s: float = Field(default=DEFAULT_LOAD_SYNC_INTERVAL_S, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, url: str | None) -> str | None:
        if url is not None:
            from prefix_index.redis_connect import parse_redis_url  # redis-py parses it: loaded only for a URL

            parse_redis_url(url)  # its ValueError names the forms it takes
        return url

    @model_validator(mode="after")
    def _redis_needs_url(self) -> IndexSection:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("backend 'redis' needs redis_url (or set KAPPA_REDIS_URL)")
        if self.breaker_max_open_s < self.breaker_open_s:
            raise ValueError(f"breaker_max_open_s ({self.breaker_max_open_s}) must be >= breaker_open_s "
                             f"({self.breaker_open_s})")
        return self


class MeasuredFiguresSection(StrictSection):
    """``routing.measured_figures``: route on what the backends are measured to do (`router.link_factors`).

    Attributes:
        enabled: price each backend with its measured factors blended with the profile (false: on
            the profile alone, the decisions of before; the fit still runs and is reported).
        prior_requests: the profile's worth in requests of evidence (n0 of the blend).
        time_constant_s: the fit's evidence ages with this time constant, s (drift).
        deviation_ratio: a factor measured beyond this many times its profile's is logged once and
            shown by ``crit --config`` (> 1).
    """

    enabled: bool = True
    prior_requests: float = Field(default=DEFAULT_PRIOR_REQUESTS, ge=0)
    time_constant_s: float = Field(default=DEFAULT_TIME_CONSTANT_S, gt=0)
    deviation_ratio: float = Field(default=DEFAULT_DEVIATION_RATIO, gt=1)

    def settings(self) -> MeasurementSettings:
        """The router's form of this section."""
        return MeasurementSettings(enabled=self.enabled, prior_requests=self.prior_requests,
                                   time_constant_s=self.time_constant_s, deviation_ratio=self.deviation_ratio)


class RoutingSection(StrictSection):
    policy: str = "kappa"
    params: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = None
    measured_figures: MeasuredFiguresSection = Field(default_factory=MeasuredFiguresSection)

    @model_validator(mode="after")
    def _policy_builds(self) -> RoutingSection:
        try:
            build_policy(self.policy, self.params)
        except PolicyConfigError as exc:
            raise ValueError(str(exc)) from exc
        return self


# Sustained pool → GPU bandwidth per GPU when the config gives none: one 400 Gb/s NIC per GPU
# (HGX H100/B200 nodes carry 8 × ConnectX-7) at half its 50 GB/s line rate. An assumption
# to replace with a measured figure, like the host link's 15 GB/s (DESIGN.md §3).
DEFAULT_POOL_LINK_GB_S_PER_GPU = 25.0


class KvPoolSection(StrictSection):
    """A KV store every backend shares (Mooncake Store, an LMCache remote backend, Dynamo's
    shared tiers): each backend writes the blocks it prefills there and may load any prefix
    block found there. ``kappa-gateway mock-fleet`` models it with one pool shared by its mocks.

    Attributes:
        capacity_gb: pool size, GB (10^9 bytes), > 0; least recently used blocks go first.
        link_gb_s_per_gpu: sustained pool → HBM bandwidth per GPU, GB/s; a backend's pool
            link is min(this, its host link per GPU) × TP unless it sets ``kv_pool_link_gb_s``.
    """

    capacity_gb: float = Field(gt=0)
    link_gb_s_per_gpu: float = Field(default=DEFAULT_POOL_LINK_GB_S_PER_GPU, gt=0)
