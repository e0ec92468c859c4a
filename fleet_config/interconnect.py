"""The ``interconnect:`` section: the paths KV crosses between backends of a P/D fleet.

YAML::

    interconnect:
      default:    {bandwidth_gb_s: 25, latency_s: 0.0005, kind: rdma}    # any two backends
      intra_node: {bandwidth_gb_s: 450, latency_s: 0.00002, kind: nvlink} # two backends of one `node`
      links:                                                             # per pair (both directions)
        - {between: [b200-0, h100-0], bandwidth_gb_s: 50, latency_s: 0.0002, kind: rdma}

Figures are sustained ones (what the path delivers under load, GB/s of 10^9 bytes per second, per
direction), not datasheet peaks: a 400 Gb/s NIC's 50 GB/s is a ceiling; NIXL over UCX on RDMA
sustains less, and over TCP far less. Resolution for a pair: a ``links`` entry, else
``intra_node`` when both backends name the same ``node``, else ``default``; a pair with none of
them is never split (`router.links.Interconnect`). A backend's role is its ``kv_role``
(`fleet_config.settings.BackendEntry`); a fleet with a ``prefill`` backend needs a link from it to
a backend that decodes (checked at start-up).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fleet_config.sections import StrictSection
from router.links import Interconnect, Link

DEFAULT_DEGRADED_RATIO = 0.5
"""A link delivering under half its configured figure is degraded: well past run-to-run noise, well
short of the 50× a TCP fallback costs against RDMA."""
DEFAULT_PROBE_INTERVAL_S = 10.0
"""Seconds before a degraded link is tried again: ten scrape intervals at the default 1 s."""

LinkKindName = Literal["nvlink", "rdma", "tcp"]
KvRole = Literal["prefill", "decode", "both"]
"""A backend's part in P/D serving: ``prefill`` (vLLM ``kv_role: kv_producer``: prefills, its KV
read by decode backends), ``decode`` (``kv_consumer``: decodes KV prefilled elsewhere, or prefills
locally when a request is not split), ``both`` (``kv_both``, or no connector: aggregated serving)."""


class LinkFigures(StrictSection):
    """One path's sustained figures.

    Attributes:
        bandwidth_gb_s: sustained bandwidth per direction, GB/s (> 0).
        latency_s: fixed cost per transfer (handshake, descriptors), s (≥ 0).
        kind: what carries it: ``nvlink``, ``rdma`` or ``tcp``.
    """

    bandwidth_gb_s: float = Field(gt=0)
    latency_s: float = Field(default=0.0, ge=0)
    kind: LinkKindName = "rdma"

    def link(self) -> Link:
        return Link.of(self.bandwidth_gb_s, self.latency_s, self.kind)


class PairLink(LinkFigures):
    """A link between two named backends (both directions).

    Attributes:
        between: the two backend ids (distinct).
    """

    between: tuple[str, str]

    @field_validator("between")
    @classmethod
    def _two_distinct(cls, value: tuple[str, str]) -> tuple[str, str]:
        if value[0] == value[1]:
            raise ValueError(f"a link joins two different backends, got {list(value)}")
        return value


class InterconnectSection(StrictSection):
    """The fleet's KV paths (module docstring).

    Attributes:
        default: the link between any two backends not otherwise listed (``None``: only the
            listed pairs and nodes link).
        intra_node: the link between two backends whose ``node`` is the same.
        links: per-pair links, overriding both.
        degraded_ratio: a link measured to deliver less than this share of its figure is degraded
            and carries no split (`gateway.backends.pd_links`), in (0, 1).
        probe_interval_s: seconds a degraded or broken link waits before a probe lets it carry
            splits again for one scrape window (> 0).
    """

    default: LinkFigures | None = None
    intra_node: LinkFigures | None = None
    links: list[PairLink] = Field(default_factory=list)
    degraded_ratio: float = Field(default=DEFAULT_DEGRADED_RATIO, gt=0, lt=1)
    probe_interval_s: float = Field(default=DEFAULT_PROBE_INTERVAL_S, gt=0)

    def table(self, nodes: dict[str, str]) -> Interconnect:
        """The router's `Interconnect`, with ``nodes`` (backend id → node name)."""
        pairs: dict[tuple[str, str], Link] = {}
        for entry in self.links:
            a, b = entry.between
            pairs[(a, b)] = pairs[(b, a)] = entry.link()
        return Interconnect(pairs=pairs, nodes=nodes,
                            intra_node=self.intra_node.link() if self.intra_node else None,
                            default=self.default.link() if self.default else None)
