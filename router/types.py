"""The router's inputs and outputs: immutable snapshots in, a ranked decision out.

The gateway (live) and the simulator (virtual time) build these from what they know —
the prefix index's match, the in-flight ledger, scraped vLLM metrics — so every policy is
a function of plain values, table-testable without I/O (STYLE.md B1, llm-d's scorers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from router.cost import BackendSpec, CostEstimate
from router.links import NO_INTERCONNECT, Interconnect, Link


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the router knows of a request before sending it.

    Args:
        model: the requested model name.
        prompt_tokens: P, the estimated prompt length (tokens).
        max_tokens: tokens the request may generate (its KV grows by this much).
        prompt_blocks: full index blocks in the prompt's hash chain.
        block_size_tokens: tokens one index block stands for (bytes per block ÷ bytes per token).
        sequences: output sequences asked for (OpenAI's ``n``; each holds its own output KV).
    """

    model: str
    prompt_tokens: int
    max_tokens: int
    prompt_blocks: int
    block_size_tokens: float
    sequences: int = 1

    def __reduce__(self) -> tuple[type[RequestFeatures], tuple[object, ...]]:
        """Pickled as its fields, in order (a frozen class compiled by mypyc cannot be unpickled
        field by field: `hot_path`)."""
        return (RequestFeatures, (self.model, self.prompt_tokens, self.max_tokens, self.prompt_blocks,
                                  self.block_size_tokens, self.sequences))


class BackendView(NamedTuple):
    """One candidate backend as the router sees it at decision time.

    Index figures are in index blocks; the ledger figures are the gateway's own (updated
    at decision time, not after); the scraped ones lag by the scrape interval.

    Args:
        backend_id: the config's id.
        spec: static model/hardware figures.
        matched_blocks, hbm_blocks, host_blocks: the prefix index's match for this request (index
            blocks; fractional where the exact index's engine blocks are converted: `dispatch.exact`).
        kv_pool_blocks: blocks past this backend's own match that the fleet-shared KV pool holds
            (loadable from it; included in ``matched_blocks``).
        in_flight_blocks: leading blocks that requests the gateway has in flight there hold
            (their KV is already in ``kv_demand_bytes``: not charged again).
        context_tokens: Σ over the requests in flight there of the context their decode steps
            read, sequences · (prompt + max_tokens / 2), tokens (`dispatch.Ledger`).
        output_tokens: Σ over them of sequences · max_tokens, tokens.
        foreign_requests: requests the last scrape found there beyond the ledger (traffic that
            bypassed the gateway; `dispatch.Target.scraped`).
        cached_blocks: blocks the index holds for this backend (its "tree size").
        in_flight: requests the gateway has sent there and not seen finish.
        kv_demand_bytes: KV bytes charged to those requests ((K+T+max_tokens)·B_kv each).
        outstanding_prefill_s: predicted prefill seconds of those not yet past first token.
        kv_capacity_bytes: KV memory of the backend (scraped num_gpu_blocks × block bytes, or
            the profile's HBM minus weights).
        num_requests_waiting, num_requests_running, kv_cache_usage_ratio: scraped from /metrics.
    """

    backend_id: str
    spec: BackendSpec
    matched_blocks: float = 0
    hbm_blocks: float = 0
    host_blocks: float = 0
    cached_blocks: int = 0
    in_flight: int = 0
    kv_demand_bytes: float = 0.0
    outstanding_prefill_s: float = 0.0
    kv_capacity_bytes: float = 0.0
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage_ratio: float = 0.0
    kv_pool_blocks: float = 0
    in_flight_blocks: float = 0
    context_tokens: float = 0.0
    output_tokens: float = 0.0
    foreign_requests: int = 0

    @property
    def free_kv_bytes(self) -> float:
        return self.kv_capacity_bytes - self.kv_demand_bytes


class Candidate(NamedTuple):
    """One backend's figures for this request (tokens; the cost model's estimate)."""

    backend_id: str
    cached_hbm_tokens: int
    cached_host_tokens: int
    uncached_prompt_tokens: int
    estimate: CostEstimate
    admitted: bool  # (K+T+max_tokens)·B_kv fits its free KV memory
    cached_kv_pool_tokens: int = 0  # found only in the fleet-shared KV pool: loaded from it

    @property
    def cached_tokens(self) -> int:
        return self.cached_hbm_tokens + self.cached_host_tokens + self.cached_kv_pool_tokens


class PrefillLeg(NamedTuple):
    """The prefill half of a split request (P/D): prefilled on one backend, its KV moved to the
    decode backend (`Decision.ranked[0]`) over the link between them (`router.links`).

    Attributes:
        candidate: the request on the prefill backend (its cache there, its queue, its prefill).
        transfer_tokens: prompt tokens whose KV crosses the link, P − K_d (the decode backend
            pulls only the blocks it lacks), ≥ 0.
        transfer_s: predicted seconds of that transfer (`router.links.Link.transfer_s`).
        link: the link it crosses.
    """

    candidate: Candidate
    transfer_tokens: int
    transfer_s: float
    link: Link


@dataclass(frozen=True, slots=True)
class PdFleet:
    """What a disaggregated (P/D) decision needs beyond the views: roles and usable links.

    Attributes:
        roles: backend id → ``prefill`` | ``decode`` | ``both`` (absent: ``both``).
        interconnect: the configured links (`router.links.Interconnect`).
        unusable: (prefill id, decode id) pairs whose link the gateway found degraded or
            broken: never split over them.
    """

    roles: dict[str, str]
    interconnect: Interconnect
    unusable: frozenset[tuple[str, str]] = frozenset()

    def role(self, backend_id: str) -> str:
        return self.roles.get(backend_id, "both")

    def unsplit(self) -> PdFleet:
        """The same roles with no link: every request goes whole to a backend that decodes."""
        return PdFleet(self.roles, NO_INTERCONNECT, self.unusable)

    def usable_link(self, prefill_id: str, decode_id: str) -> Link | None:
        """The link a split from ``prefill_id`` to ``decode_id`` would cross, if it may be used."""
        if (prefill_id, decode_id) in self.unusable:
            return None
        return self.interconnect.link(prefill_id, decode_id)


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's choice and its fallbacks.

    ``ranked`` lists every candidate best first: ``ranked[0]`` is the choice, the rest are
    where a retry goes (a connect error or 5xx before the first byte). With ``prefill`` set the
    request is split (P/D): prefilled on ``prefill.candidate``'s backend, decoded on
    ``ranked[0]``'s; the rest of ``ranked`` are aggregated fallbacks (a decode backend prefills
    locally when it gets no ``kv_transfer_params``).
    """

    policy: str
    ranked: tuple[Candidate, ...]
    reason: str
    prefill: PrefillLeg | None = None

    def __reduce__(self) -> tuple[type[Decision], tuple[object, ...]]:
        """Pickled as its fields (see `RequestFeatures.__reduce__`)."""
        return (Decision, (self.policy, self.ranked, self.reason, self.prefill))

    @property
    def chosen(self) -> Candidate:
        return self.ranked[0]
