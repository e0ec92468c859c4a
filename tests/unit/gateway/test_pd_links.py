"""The P/D links' check (`gateway.backends.pd_links`): a link that delivers a fiftieth of its figure
is degraded, one whose transfers fail or read "No Data" is broken, and a probe brings either back."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dispatch import BackendMetrics
from fleet_config.interconnect import DEFAULT_PROBE_INTERVAL_S as PROBE_INTERVAL_S
from gateway.backends.pd_links import DRY_SCRAPES, MATCH_SCRAPES, MIN_TRANSFERS, PdLinks
from gateway.telemetry.pd import PdTelemetry
from router.links import Interconnect, Link, LinkHealth

GB = 1e9
CONFIGURED = Link.of(50.0, 0.0005, "rdma")
TRANSFER_BYTES = 2 * GB  # ~6,100 tokens of Llama-3.1-70B


class Harness:
    def __init__(self) -> None:
        self.now = 0.0
        self.registry = CollectorRegistry()
        self.changes: list[frozenset[tuple[str, str]]] = []
        self.links = PdLinks([("p", "d"), ("p2", "d")], Interconnect(default=CONFIGURED), PdTelemetry(self.registry),
                             lambda: self.now, self.changes.append)
        self.metrics = BackendMetrics(kv_transfer_count=0.0)

    def transfer(self, delivered_gb_s: float, *, prefill: str = "p", n: int = 1, exported: bool = True,
                 moved: bool = True, failed: int = 0) -> None:
        """``n`` splits over link(prefill, d) whose pulls ran at ``delivered_gb_s``, then a scrape of d."""
        for _ in range(n):
            self.links.transferred(prefill, "d", TRANSFER_BYTES)
        m = self.metrics
        seconds = n * (CONFIGURED.latency_s + TRANSFER_BYTES / (delivered_gb_s * GB)) if moved else 0.0
        current = BackendMetrics(
            kv_transfer_count=(m.kv_transfer_count or 0.0) + (n if moved else 0) if exported else None,
            kv_transfer_seconds_total=m.kv_transfer_seconds_total + seconds,
            kv_transfer_bytes_total=m.kv_transfer_bytes_total + (n * TRANSFER_BYTES if moved else 0.0),
            kv_transfer_failures_total=m.kv_transfer_failures_total + failed)
        self.now += 1.0
        self.links.scraped("d", m, current)
        self.metrics = current

    def state(self, prefill: str = "p") -> LinkHealth:
        return self.links.links[(prefill, "d")].state

    def gauge(self, name: str, prefill: str = "p") -> float | None:
        return self.registry.get_sample_value(name, {"prefill_backend": prefill, "decode_backend": "d"})


def test_a_link_that_delivers_its_figure_stays_healthy_and_says_what_it_measured() -> None:
    h = Harness()
    h.transfer(45.0, n=MIN_TRANSFERS)
    assert h.state() is LinkHealth.HEALTHY and not h.changes
    assert h.links.links[("p", "d")].delivered_bytes_per_s == pytest_approx(45 * GB)
    assert h.gauge("gateway_pd_link_state") == 0
    assert h.gauge("gateway_pd_link_configured_bytes_per_second") == 50 * GB


def test_a_link_that_delivers_a_fiftieth_is_degraded_after_enough_transfers_then_probed_back() -> None:
    h = Harness()
    h.transfer(1.0, n=MIN_TRANSFERS - 1)
    assert h.state() is LinkHealth.HEALTHY  # one or two transfers are not evidence enough
    h.transfer(1.0)
    assert h.state() is LinkHealth.DEGRADED
    assert h.changes == [frozenset({("p", "d")})]
    assert h.gauge("gateway_pd_link_state") == 1
    assert h.gauge("gateway_pd_link_delivered_bytes_per_second") == pytest_approx(1.0 * GB)
    assert "2.0% of its configured 50 GB/s" in h.links.links[("p", "d")].reason
    # No split goes over it; after the probe interval one window lets it through.
    h.now += PROBE_INTERVAL_S
    h.transfer(1.0, prefill="p2")
    assert h.links.links[("p", "d")].probing and h.changes[-1] == frozenset()
    h.transfer(1.0)  # the probe: still slow
    assert h.state() is LinkHealth.DEGRADED and h.changes[-1] == frozenset({("p", "d")})
    h.now += PROBE_INTERVAL_S
    h.transfer(48.0, prefill="p2")
    h.transfer(48.0)  # recovered
    assert h.state() is LinkHealth.HEALTHY and h.changes[-1] == frozenset()


def test_failed_pulls_break_the_link_at_once() -> None:
    h = Harness()
    h.transfer(50.0, failed=1)
    assert h.state() is LinkHealth.BROKEN and h.gauge("gateway_pd_link_state") == 2
    assert "failed KV transfers" in h.links.links[("p", "d")].reason


def test_no_data_while_transfers_are_expected_breaks_the_link() -> None:
    """The GH200-without-RDMA failure: splits go out, the decode engine's transfer metrics read
    nothing. A scrape or two may just lag the gateway's count, and one split may have pulled nothing
    (its decoder held every block): broken only once MIN_TRANSFERS were expected over DRY_SCRAPES."""
    for exported in (False, True):
        h = Harness()
        for _ in range(MIN_TRANSFERS - 1):
            h.transfer(50.0, exported=exported, moved=False)
            assert h.state() is LinkHealth.HEALTHY
        for _ in range(MATCH_SCRAPES + DRY_SCRAPES):
            h.transfer(50.0, exported=exported, moved=False)
        assert h.state() is LinkHealth.BROKEN
        assert "no data" in h.links.links[("p", "d")].reason


def test_a_split_that_pulled_nothing_is_no_evidence() -> None:
    h = Harness()
    for _ in range(MATCH_SCRAPES + DRY_SCRAPES + MIN_TRANSFERS):
        h.links.transferred("p", "d", 0.0)  # its decoder held every block
        h.links.scraped("d", h.metrics, h.metrics)
    assert h.state() is LinkHealth.HEALTHY


def test_a_probe_no_split_takes_gives_its_turn_to_the_next_link() -> None:
    h = Harness()
    rates = {"p": 1.0, "p2": 1.0}
    for _ in range(MIN_TRANSFERS):
        scrape_mixed(h, {"p": 2.0, "p2": 2.0}, rates)
    assert h.state("p") is h.state("p2") is LinkHealth.DEGRADED
    h.now += PROBE_INTERVAL_S
    scrape_mixed(h, {}, rates)
    first = [k for k, r in h.links.links.items() if r.probing]
    h.now += PROBE_INTERVAL_S  # the router never split over it
    scrape_mixed(h, {}, rates)
    second = [k for k, r in h.links.links.items() if r.probing]
    assert len(first) == len(second) == 1 and first != second


def scrape_mixed(h: Harness, gb: dict[str, float], rates: dict[str, float]) -> None:
    """One window of d carrying ``gb[p]`` GB from each prefill p at ``rates[p]`` GB/s."""
    for prefill, size in gb.items():
        h.links.transferred(prefill, "d", size * GB)
    m = h.metrics
    seconds = sum(CONFIGURED.latency_s + size / rates[p] for p, size in gb.items())
    current = BackendMetrics(kv_transfer_count=(m.kv_transfer_count or 0) + len(gb),
                             kv_transfer_seconds_total=m.kv_transfer_seconds_total + seconds,
                             kv_transfer_bytes_total=m.kv_transfer_bytes_total + sum(gb.values()) * GB)
    h.now += 1.0
    h.links.scraped("d", m, current)
    h.metrics = current


def test_a_slow_link_is_told_apart_from_a_fast_one_into_the_same_decoder() -> None:
    """p → d at 1 GB/s, p2 → d at its 50, always in the same windows but in varying shares: the fit
    over the windows gives each its own figure."""
    h = Harness()
    rates = {"p": 1.0, "p2": 50.0}
    for mix in ({"p": 2.0, "p2": 2.0}, {"p": 1.0, "p2": 3.0}, {"p": 3.0, "p2": 1.0}, {"p": 0.5, "p2": 2.5}):
        scrape_mixed(h, mix, rates)
    assert h.state("p") is LinkHealth.DEGRADED
    assert h.state("p2") is LinkHealth.HEALTHY
    assert h.links.links[("p2", "d")].delivered_bytes_per_s == pytest_approx(50 * GB)


def test_links_that_always_come_together_are_judged_together_then_probed_one_at_a_time() -> None:
    h = Harness()
    rates = {"p": 1.0, "p2": 50.0}
    for _ in range(MIN_TRANSFERS):
        scrape_mixed(h, {"p": 2.0, "p2": 2.0}, rates)
    assert h.state("p") is h.state("p2") is LinkHealth.DEGRADED
    assert "cannot be told apart" in h.links.links[("p2", "d")].reason
    h.now += PROBE_INTERVAL_S
    scrape_mixed(h, {}, rates)  # a scrape with nothing sent: the first probe opens
    probing = [k for k, r in h.links.links.items() if r.probing]
    assert len(probing) == 1  # one at a time
    scrape_mixed(h, {probing[0][0]: 2.0}, rates)
    scrape_mixed(h, {}, rates)  # the second probe opens (the first has waited its turn)
    probing2 = [k for k, r in h.links.links.items() if r.probing]
    if probing2:
        scrape_mixed(h, {probing2[0][0]: 2.0}, rates)
    assert h.state("p2") is LinkHealth.HEALTHY
    assert h.state("p") is LinkHealth.DEGRADED


def pytest_approx(value: float):  # noqa: ANN201 -- a local alias keeps the asserts on one line
    import pytest
    return pytest.approx(value, rel=1e-3)
