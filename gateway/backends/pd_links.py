"""The P/D links verified: what each prefill → decode path really delivers, and which may carry splits.

The failure practitioners warn about: a P/D deployment whose KV transfers silently fail or crawl
(a GH200 without RDMA, NIXL falling back to TCP) — every transfer metric reads "No Data", and P/D
collapses into aggregated serving at half the memory, or worse, keeps splitting over a path that
delivers a fiftieth of its datasheet figure. The gateway measures each link from the decode
engines' own KV-connector metrics (vLLM's NixlConnector: ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred``, whose ``_sum`` and ``_count`` say how many bytes the engine pulled
in how many seconds, and ``vllm:nixl_num_failed_transfers_total``) and from its own count of the
splits it sent over each link since the last scrape:

- **broken**: pulls failed (the failure counter moved), or the gateway sent splits over the link
  and completed their decode phase, yet the decode engine's transfer metrics are absent or did not
  move ("No Data");
- **degraded**: over at least ``MIN_TRANSFERS`` transfers, it delivered less than
  ``degraded_ratio`` (default a half) of its configured sustained bandwidth. A window's seconds are shared between
  the links that carried transfers into that decode engine: each other link is charged what its
  own figure (measured, else configured) says its bytes took, the rest is this link's. Latency is
  taken out (``latency_s`` per transfer) so small transfers do not read as a slow link;
- **healthy**: otherwise (and before any evidence).

A link that is not healthy carries no split (`router.types.PdFleet.unusable`): requests go whole
to a backend that decodes. Every ``probe_interval_s`` (default 10 s) such a link is let through again for one
window — the next split the router prices over it is the probe — and is healthy again if that
window measures it so. Each change of state is logged once, and exported as
``gateway_pd_link_state`` (`gateway.telemetry.pd`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dispatch import BackendMetrics
from fleet_config.interconnect import DEFAULT_DEGRADED_RATIO, DEFAULT_PROBE_INTERVAL_S
from gateway.telemetry.pd import LINK_STATE_VALUES, PdTelemetry
from router.least_squares import robust_least_squares
from router.links import Interconnect, Link, LinkHealth

log = logging.getLogger("kappa_gateway.pd_links")

MIN_TRANSFERS = 3
"""Transfers measured before a link's bandwidth is judged (one transfer can be an outlier)."""
DRY_SCRAPES = 2
"""Scrapes with splits expected and no KV-transfer data before a link is called broken ("No Data")."""
MATCH_SCRAPES = 3
"""Scrapes the gateway waits for a decode engine's transfer count to reach its own count of splits there
before it judges what moved (a window whose pulls and first bytes straddle a scrape is not judged on
half of it)."""
FOREIGN_SCRAPES = 2
"""Scrapes of a decode engine not judged after a request with the client's own kv_transfer_params went there."""
IDLE_SCRAPES = 30
"""Scrapes without a split of ours after which a decode engine's accumulated transfer figures are dropped."""
WINDOWS = 32
"""Scrape windows per decode engine the per-link fit keeps (the oldest go first)."""
GB = 1e9


def _fit(windows: list[tuple[dict[tuple[str, str], float], float]]) -> dict[tuple[str, str], float] | None:
    """Seconds per GB of each link into one decode engine, from its windows ({link: GB}, seconds).

    Robust least squares through the origin over the windows (`router.least_squares`: a window's
    seconds = Σ_l GB over l × s/GB of l), which tells links apart once their mixes vary; where it
    cannot (too few windows, or always the same mix), the windows each link carried alone. None when
    neither tells any link apart.
    """
    keys = sorted({k for w, _ in windows for k in w})
    if len(windows) > len(keys):
        fit = robust_least_squares([[w.get(k, 0.0) for k in keys] for w, _ in windows], [t for _, t in windows])
        if fit is not None and all(b > 0 for b in fit.beta):
            return dict(zip(keys, fit.beta))
    alone: dict[tuple[str, str], tuple[float, float]] = {}
    for w, t in windows:
        if len(w) == 1:
            [(k, gb)] = w.items()
            was = alone.get(k, (0.0, 0.0))
            alone[k] = (was[0] + gb, was[1] + t)
    return {k: t / gb for k, (gb, t) in alone.items() if gb > 0} or None


@dataclass(slots=True)
class _Pulled:
    """What one decode engine's KV-transfer metrics moved by since its links were last judged."""

    count: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    failed: float = 0.0
    exported: bool = False
    dry: int = 0
    idle: int = 0
    short: int = 0
    foreign: int = 0  # scrapes left in which a client's own transfer may show (not judged)
    # The judged windows, newest last: ({link: GB it carried}, seconds less latency); kept across resets.
    windows: deque[tuple[dict[tuple[str, str], float], float]] = field(default_factory=lambda: deque(maxlen=WINDOWS))

    def add(self, previous: BackendMetrics, current: BackendMetrics, tensor_parallel: int) -> None:
        self.exported = current.kv_transfer_count is not None
        if current.kv_transfer_count is None or previous.kv_transfer_count is None:
            return
        if current.kv_transfer_count < previous.kv_transfer_count:  # a restart: counters start again
            return
        self.count += (current.kv_transfer_count - previous.kv_transfer_count) / tensor_parallel
        self.bytes += current.kv_transfer_bytes_total - previous.kv_transfer_bytes_total
        self.seconds += (current.kv_transfer_seconds_total - previous.kv_transfer_seconds_total) / tensor_parallel
        self.failed += max(current.kv_transfer_failures_total - previous.kv_transfer_failures_total, 0.0)

    def waited(self) -> bool:
        """One more scrape in which the engine's transfers fell short of the gateway's count; True once
        MATCH_SCRAPES of them have passed (judge what there is: some splits pulled nothing)."""
        self.short += 1
        return self.short >= MATCH_SCRAPES

    def idle_scrapes(self) -> bool:
        """One more scrape without a split of ours: True when what accumulated is too old to match one
        (IDLE_SCRAPES). Kept until then: an engine's pull ends before the gateway sees the decode's
        first byte, so its metrics may move a scrape or two before the gateway counts the split."""
        self.idle += 1
        return self.idle >= IDLE_SCRAPES

    def reset(self) -> None:
        self.count = self.bytes = self.seconds = self.failed = 0.0
        self.dry = self.idle = self.short = 0


@dataclass(slots=True)
class LinkRecord:
    """One link's configured figure, state and evidence."""

    prefill_id: str
    decode_id: str
    configured: Link
    state: LinkHealth = LinkHealth.HEALTHY
    reason: str = "no transfer seen yet"
    since_s: float = 0.0
    probing: bool = False
    probe_s: float = 0.0  # when its probe began
    delivered_bytes_per_s: float | None = None
    transfers: int = 0  # transfers measured (since its last probe)
    window_bytes: float = 0.0  # splits sent over it since its decode engine's last scrape
    window_transfers: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"prefill_backend": self.prefill_id, "decode_backend": self.decode_id, "kind": self.configured.kind.value,
                "configured_bytes_per_s": self.configured.bandwidth_bytes_per_s, "latency_s": self.configured.latency_s,
                "state": self.state.value, "reason": self.reason, "probing": self.probing,
                "delivered_bytes_per_s": self.delivered_bytes_per_s, "transfers_measured": self.transfers}


@dataclass
class PdLinks:
    """Every link from a backend that prefills to one that decodes, verified (module docstring).

    Args:
        pairs: (prefill id, decode id) of every link that may carry splits.
        interconnect: their configured figures.
        telemetry: the P/D metrics.
        clock: monotonic seconds.
        on_change: called with the unusable pairs whenever that set changes.
        degraded_ratio, probe_interval_s: `fleet_config.interconnect.InterconnectSection`'s.
        tensor_parallel: decode backend id → its TP ranks. vLLM's NixlConnector records each reading
            rank's share (bytes / TP) over the whole transfer's duration, so the summed transfer time
            counts every transfer TP times: the engine's seconds are divided by it (absent: 1).
    """

    pairs: Iterable[tuple[str, str]]
    interconnect: Interconnect
    telemetry: PdTelemetry
    clock: Callable[[], float]
    on_change: Callable[[frozenset[tuple[str, str]]], None]
    tensor_parallel: dict[str, int] = field(default_factory=dict)
    degraded_ratio: float = DEFAULT_DEGRADED_RATIO
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    links: dict[tuple[str, str], LinkRecord] = field(init=False)
    _pulled: dict[str, _Pulled] = field(init=False)

    def __post_init__(self) -> None:
        self.links = {}
        self._pulled = {}
        for p, d in self.pairs:
            link = self.interconnect.link(p, d)
            if link is not None:
                self.links[(p, d)] = LinkRecord(p, d, link, since_s=self.clock())
                self.telemetry.link_state.labels(p, d).set(0)
                self.telemetry.link_configured.labels(p, d).set(link.bandwidth_bytes_per_s)

    def unusable(self) -> frozenset[tuple[str, str]]:
        return frozenset(k for k, r in self.links.items() if r.state is not LinkHealth.HEALTHY and not r.probing)

    def transferred(self, prefill_id: str, decode_id: str, kv_bytes: float) -> None:
        """A split's decode phase got its first byte: its ``kv_bytes`` crossed link(prefill, decode)."""
        record = self.links.get((prefill_id, decode_id))
        if record is not None and kv_bytes > 0:  # a decoder that holds every block pulls nothing
            record.window_bytes += kv_bytes
            record.window_transfers += 1

    def foreign_transfer(self, decode_id: str) -> None:
        """A request with the client's own ``kv_transfer_params`` went to ``decode_id``: whatever its
        engine pulls (or fails to) in the next FOREIGN_SCRAPES scrapes is not the gateway's links' doing
        (vLLM's transfer metrics name no peer), so those windows are not judged."""
        self._pulled.setdefault(decode_id, _Pulled()).foreign = FOREIGN_SCRAPES

    def scraped(self, decode_id: str, previous: BackendMetrics, current: BackendMetrics) -> None:
        """A scrape of ``decode_id``: judge the links into it on what it pulled since it was last judged.

        The engine's counters and the gateway's count of splits need not move in the same scrape
        interval (a pull ends just before a scrape, its first byte reaches the gateway just after),
        so both accumulate until both have moved; "No Data" is called only after ``DRY_SCRAPES``
        scrapes in which splits were expected and the engine's transfer metrics did not move.
        """
        into = [r for r in self.links.values() if r.decode_id == decode_id]
        if not into:
            return
        pulled = self._pulled.setdefault(decode_id, _Pulled())
        pulled.add(previous, current, self.tensor_parallel.get(decode_id, 1))
        used = [r for r in into if r.window_transfers]
        before = self.unusable()
        if pulled.foreign:  # a client's own transfer may be in these figures: judge nothing
            pulled.foreign -= 1
            self._settled(used, pulled)
        elif used and (pulled.count >= sum(r.window_transfers for r in used) or pulled.waited()):
            self._judge(used, pulled)
        elif pulled.idle_scrapes():  # long without a split of ours: what moved was another gateway's
            pulled.reset()
        self._probe(into)
        after = self.unusable()
        if after != before:
            self.on_change(after)

    def _judge(self, used: list[LinkRecord], pulled: _Pulled) -> None:
        expected = sum(r.window_transfers for r in used)
        if pulled.failed > 0:
            for r in used:
                self._set(r, LinkHealth.BROKEN, f"{pulled.failed:g} failed KV transfers into {r.decode_id} "
                          f"(vllm:nixl_num_failed_transfers) while it carried {r.window_transfers}")
            self._settled(used, pulled)
            return
        if pulled.count <= 0 or pulled.bytes <= 0 or pulled.seconds <= 0:
            pulled.dry += 1
            if pulled.dry >= DRY_SCRAPES and expected >= MIN_TRANSFERS:
                what = "exports no KV-transfer metrics" if not pulled.exported else "KV-transfer metrics did not move"
                for r in used:
                    self._set(r, LinkHealth.BROKEN, f"no data: {expected} transfers expected into {r.decode_id} over "
                              f"{pulled.dry} scrapes, its {what} (vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred)")
                self._settled(used, pulled)
            return
        counted = sum(r.window_bytes for r in used) or 1.0
        # The engine's bytes, shared as the gateway's own counts of each link's splits share them (GB).
        share = {(r.prefill_id, r.decode_id): pulled.bytes * r.window_bytes / counted / GB for r in used}
        latency = sum(r.window_transfers * r.configured.latency_s for r in used)
        pulled.windows.append((share, max(pulled.seconds - latency, 1e-9)))
        for r in used:
            r.transfers += r.window_transfers
        seconds_per_gb = _fit(list(pulled.windows))
        if seconds_per_gb is None:
            self._unresolved(used, pulled)
        else:
            for r in used:
                per_gb = seconds_per_gb.get((r.prefill_id, r.decode_id))
                if per_gb is not None and (r.transfers >= MIN_TRANSFERS or r.probing):
                    self._measured(r, GB / per_gb if per_gb > 0 else math.inf)
        self._settled(used, pulled)

    def _unresolved(self, used: list[LinkRecord], pulled: _Pulled) -> None:
        """Several links into one decoder, always together: their shares cannot be told apart. Judged
        as one: when together they deliver under ``degraded_ratio`` of their figures, none carries splits
        (the probes then try each)."""
        gb = sum(sum(w.values()) for w, _ in pulled.windows)
        seconds = sum(t for _, t in pulled.windows)
        expected = sum(gb_l * GB / self.links[k].configured.bandwidth_bytes_per_s
                       for w, _ in pulled.windows for k, gb_l in w.items())
        if seconds > 0 and expected / seconds < self.degraded_ratio and all(r.transfers >= MIN_TRANSFERS for r in used):
            for r in used:
                self._set(r, LinkHealth.DEGRADED, f"the links into {r.decode_id} delivered {gb / seconds:.3g} GB/s "
                          f"together, {expected / seconds:.1%} of their figures; which one is slow cannot be told "
                          "apart yet (the probes will)")

    def _measured(self, r: LinkRecord, delivered: float) -> None:
        r.delivered_bytes_per_s = delivered
        self.telemetry.link_delivered.labels(r.prefill_id, r.decode_id).set(delivered)
        ratio = delivered / r.configured.bandwidth_bytes_per_s
        if ratio < self.degraded_ratio:
            self._set(r, LinkHealth.DEGRADED, f"delivers {delivered / 1e9:.3g} GB/s over {r.transfers} transfers, "
                      f"{ratio:.1%} of its configured {r.configured.bandwidth_bytes_per_s / 1e9:.3g} GB/s")
        else:
            self._set(r, LinkHealth.HEALTHY, f"delivers {delivered / 1e9:.3g} GB/s ({min(ratio, 9.99):.0%} of "
                      "its configured figure)")

    @staticmethod
    def _settled(used: list[LinkRecord], pulled: _Pulled) -> None:
        for r in used:
            r.window_bytes, r.window_transfers = 0.0, 0
        pulled.reset()

    def _probe(self, into: list[LinkRecord]) -> None:
        """Let one link that is not healthy through, per decode engine at a time (so that its probe's
        transfers are told apart from the other links'), once it has waited ``probe_interval_s``."""
        now = self.clock()
        for r in into:  # a probe no split has used for a probe interval gives its turn to the next link
            if r.probing and now - r.probe_s >= self.probe_interval_s:
                r.probing, r.since_s = False, now
        if any(r.probing for r in into):
            return
        for r in sorted(into, key=lambda r: r.since_s):  # the longest waiting first
            if r.state is not LinkHealth.HEALTHY and now - r.since_s >= self.probe_interval_s:
                r.probing, r.probe_s = True, now
                r.transfers = 0
                pulled = self._pulled.get(r.decode_id)
                if pulled is not None:  # its old windows would outvote the probe
                    kept = [w for w in pulled.windows if (r.prefill_id, r.decode_id) not in w[0]]
                    pulled.windows.clear()
                    pulled.windows.extend(kept)
                log.info("P/D link %s -> %s: probing (%s for %.1fs)", r.prefill_id, r.decode_id, r.state.value,
                         now - r.since_s)
                return

    def _set(self, r: LinkRecord, state: LinkHealth, reason: str) -> None:
        was_probing, r.probing = r.probing, False
        r.reason = reason
        if state is r.state:
            if was_probing:  # the probe found it as it was: another wait
                r.since_s = self.clock()
            return
        r.state, r.since_s = state, self.clock()
        self.telemetry.link_state.labels(r.prefill_id, r.decode_id).set(LINK_STATE_VALUES[state.value])
        if state is LinkHealth.HEALTHY:
            log.info("P/D link %s -> %s healthy again: %s; splits over it resume", r.prefill_id, r.decode_id, reason)
        else:
            log.error("P/D link %s -> %s is %s: %s. No requests are split over it until a probe finds it healthy "
                      "(every %gs); they go whole to a backend that decodes.", r.prefill_id, r.decode_id,
                      state.value, reason, self.probe_interval_s)
