"""Issue 13 item 4, done-when: on the demo's own traffic, every backend's κ_crit is measured
within 500 requests and lies within 10% of the mock engine's true crossover — all four, every run.
Issue 29: one factor per link, so a κ_crit per link: each backend has at least one link measured
(its host-tier loads, or its KV-pool loads, or both), and each measured one is within 10% of the
engine's own crossover at that link.

The demo's fleet (`config/fleet.local.yaml`: four mocks sharing a KV pool, in one process,
at the demo's time scale 0.4), a real gateway with the demo's settings (1 s scrapes), and
the demo's generator (`gateway.commands.demo.workload`: Mooncake-shaped, 2.5 requests/s,
seed 0) replayed through real HTTP, as ``kappa-gateway demo`` does (about 80 s). The true
crossover is computed from each mock engine's own figures — the `router.cost.BackendSpec` its
`mock_vllm.engine.MockEngine` steps by (`mock_vllm.app_factory.build_backend_app`) — as
(F_lin / B_kv) · (BW_host / C_eff), not read from the gateway. The test prints, per backend, the
error and how many requests had been answered when its κ_crit was first reported (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from fleet_config.settings import load_settings
from gateway.app import create_app
from gateway.commands.demo import (
    DEFAULT_CONFIG,
    DEFAULT_RATE_RPS,
    DEFAULT_TIME_SCALE,
    on_free_ports,
    workload,
)
from gateway.commands.fleet import mock_fleet
from gateway.commands.replay import replay
from mock_vllm.app_factory import build_backend_app
from router import kappa
from router.kappa_fit import MIN_REQUESTS
from router.link_factors import HOST
from tests.integration.gateway_support import poll
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

REQUESTS = 500
MIN_LOAD_REQUESTS = MIN_REQUESTS[HOST]
WATCH_INTERVAL_S = 0.25  # how often the test samples /v1/kappa/backends during the replay


def true_crossover(engine_spec, *, pool: bool = False) -> float:
    """The mock engine's linear κ_crit from its own figures: (F_lin / B_kv) · (BW / C_eff), BW its host
    link's (or its KV-pool link's)."""
    constants = kappa.model_constants(engine_spec.model)
    link = engine_spec.kv_pool_link_bytes_per_s if pool else engine_spec.link_bytes_per_s
    return (constants.f_linear / constants.b_kv) * (link / engine_spec.c_eff_flops_per_s)


def at_links(b: dict) -> dict[str, float]:
    """The backend's measured κ_crit by link (the links with evidence)."""
    found = {"host": b["kappa_crit_linear_measured"], "kv_pool": b["kappa_fit"].get("kappa_crit_linear_kv_pool_measured")}
    return {link: value for link, value in found.items() if value}


def backends(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/v1/kappa/backends") as resp:
        return {b["id"]: b for b in json.load(resp)["backends"]}


@pytest.mark.timeout(240)
def test_every_backend_measures_its_crossover_on_the_demos_traffic() -> None:
    catalog = default_catalog()
    settings = on_free_ports(load_settings(DEFAULT_CONFIG, catalog, env={}))
    engines = {b.id: build_backend_app(settings, b, catalog).state.engine.backend for b in settings.backends}
    app = create_app(settings, registry=CollectorRegistry())
    answered = [0]  # requests answered so far (the replay's on_result)
    first_measured: dict[str, int] = {}  # backend id → requests answered when it first reported a κ_crit
    with mock_fleet(settings, time_scale=DEFAULT_TIME_SCALE), serve_in_thread(app) as url:
        done = threading.Event()

        def watch() -> None:
            while not done.wait(WATCH_INTERVAL_S):
                for backend_id, b in backends(url).items():
                    if at_links(b) and backend_id not in first_measured:
                        first_measured[backend_id] = answered[0]

        watcher = threading.Thread(target=watch, name="kappa-watch")
        watcher.start()
        try:
            results = asyncio.run(replay(workload(REQUESTS, None, DEFAULT_RATE_RPS, 0), url=url,
                                         model=settings.served_models()[0], speedup=1 / DEFAULT_TIME_SCALE,
                                         concurrency=512, progress=False,
                                         on_result=lambda _: answered.__setitem__(0, answered[0] + 1)))
        finally:
            done.set()
            watcher.join()
        assert sum(r.error is not None for r in results) == 0

        # the requests that finished last are fitted at the next scrape (1 s)
        def all_measured() -> dict[str, dict] | None:
            current = backends(url)
            return current if all(at_links(b) for b in current.values()) else None

        try:
            measured = poll(all_measured, "every backend's measured κ_crit", timeout_s=5.0)
        except AssertionError:
            raise AssertionError(f"not measured: {[(b['id'], b['kappa_fit']) for b in backends(url).values()]}") from None
    for backend_id, engine_spec in engines.items():
        b = measured[backend_id]
        for link, value in at_links(b).items():
            truth = true_crossover(engine_spec, pool=link == "kv_pool")
            print(f"{backend_id} at its {link} link: measured {value:.4g} true {truth:.4g} ({value / truth - 1:+.2%}), "
                  f"first at {first_measured.get(backend_id, REQUESTS)} requests, load-bound fitted "
                  f"{b['kappa_fit']['requests']['load']}")
            assert value == pytest.approx(truth, rel=0.10), (backend_id, link, b["kappa_fit"])
        assert b["kappa_fit"]["requests"]["load"] >= MIN_LOAD_REQUESTS
