"""The fleet's interconnect: the path KV crosses from a prefill backend to a decode backend (P/D).

A disaggregated request is prefilled on p and decoded on d; the KV d lacks crosses link(p, d):
NVLink between GPUs of one node, RDMA NICs between nodes, TCP where RDMA is missing (vLLM's
NixlConnector picks UCX's transport; its TCP fallback is what a GH200 without RDMA ran on, and
why practitioners saw P/D collapse). The router prices the transfer as

    transfer_s = latency_s + (P − K_d) · B_kv / bandwidth_bytes_per_s

with P the prompt and K_d what d already caches (engines ship only the blocks the decode side
lacks). Figures are **sustained** ones, measured, not datasheet peaks (the paper's first finding;
DESIGN.md §3); the gateway checks them against what the engines' transfer metrics deliver
(`LinkHealth`) and stops splitting over a link that is broken or slow.

Pure: no I/O, no clock. Built once from the config (`fleet_config.Settings.interconnect`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from router.profiles import GB


class LinkKind(str, Enum):
    """What carries the KV: NVLink in a node, RDMA NICs between nodes, or TCP (no RDMA)."""

    NVLINK = "nvlink"
    RDMA = "rdma"
    TCP = "tcp"


class LinkHealth(str, Enum):
    """What the gateway has measured of a link (`/v1/kappa/backends`, ``gateway_pd_link_state``).

    ``healthy``: delivers near its configured figure, or not yet measured; ``degraded``: delivers
    far below it; ``broken``: transfers over it fail, or read no data while transfers are expected.
    Splits go only over healthy links.
    """

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    BROKEN = "broken"


class Link(NamedTuple):
    """One direction of the path between two backends.

    Attributes:
        bandwidth_bytes_per_s: sustained bandwidth, bytes/s (> 0).
        latency_s: fixed cost of one transfer (handshake, descriptor post), s (≥ 0).
        kind: what carries it (`LinkKind`).
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    kind: LinkKind

    def transfer_s(self, kv_bytes: float) -> float:
        """Seconds to move ``kv_bytes`` bytes of KV over this link (0 bytes: nothing is moved, 0 s)."""
        if kv_bytes <= 0:
            return 0.0
        return self.latency_s + kv_bytes / self.bandwidth_bytes_per_s

    @classmethod
    def of(cls, bandwidth_gb_s: float, latency_s: float, kind: LinkKind | str) -> Link:
        """A link from GB/s (10^9 bytes/s), as the config gives it."""
        return cls(bandwidth_gb_s * GB, latency_s, LinkKind(kind))


@dataclass(frozen=True, slots=True)
class Interconnect:
    """Links between backends, by (from, to) backend id.

    Resolution for a pair (p, d), p ≠ d: an explicit pair link (``pairs``), else ``intra_node``
    when both sit on one node (``nodes``), else ``default``; ``None`` when none applies (the pair
    cannot be split). A backend never links to itself.

    Attributes:
        pairs: (from id, to id) → link; the config's per-pair entries, both directions.
        nodes: backend id → node name (backends without one are on nodes of their own).
        intra_node: the link between two backends of one node (``None``: no such figure).
        default: the link between any other two backends (``None``: only listed pairs link).
    """

    pairs: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    nodes: Mapping[str, str] = field(default_factory=dict)
    intra_node: Link | None = None
    default: Link | None = None

    def link(self, from_id: str, to_id: str) -> Link | None:
        """The link KV crosses from ``from_id`` to ``to_id`` (``None``: none, or the same backend)."""
        if from_id == to_id:
            return None
        pair = self.pairs.get((from_id, to_id))
        if pair is not None:
            return pair
        node = self.nodes.get(from_id)
        if node is not None and self.intra_node is not None and self.nodes.get(to_id) == node:
            return self.intra_node
        return self.default

    @property
    def empty(self) -> bool:
        """No link at all: nothing can be split."""
        return not self.pairs and self.default is None and self.intra_node is None


NO_INTERCONNECT = Interconnect()
"""A fleet without P/D links (every aggregated fleet)."""
