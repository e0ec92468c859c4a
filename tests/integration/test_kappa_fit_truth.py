"""Issue 29, done-when: live, the demo fleet's mocks run a truth config (config/fleet.local.truth.yaml:
other host links, pool links and power caps) while the gateway runs config/fleet.local.yaml; 400
requests of the real Mooncake trace replayed at the trace's own rate (speedup 1, the mocks at time
scale 0.4): every backend gets its figures measured, and each κ_crit at a link it measured lies
within 15% of the engine's own (F_lin / B_kv) · (BW / C_eff) at that link, each factor within 10% of
the truth's. About two minutes; skipped without the real trace (``../shared/data``)."""

from __future__ import annotations

import asyncio
import os
import json
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from fleet_config.catalog import CONFIG_DIR, default_catalog
from fleet_config.settings import load_settings
from gateway.app import create_app
from gateway.commands.demo import DEFAULT_CONFIG, DEFAULT_TIME_SCALE, on_free_ports
from gateway.commands.fleet import mock_fleet
from gateway.commands.replay import replay
from mock_vllm.app_factory import build_backend_app
from router import kappa
from router.link_factors import FACTORS
from sim.real_traces import real_trace_path
from sim.traces import load_trace
from tests.integration.gateway_support import poll
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

REQUESTS = 400


def crossover(spec, *, pool: bool) -> float:  # type: ignore[no-untyped-def]
    constants = kappa.model_constants(spec.model)
    link = spec.kv_pool_link_bytes_per_s if pool else spec.link_bytes_per_s
    return (constants.f_linear / constants.b_kv) * (link / spec.c_eff_flops_per_s)


def backends(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/v1/kappa/backends") as resp:
        return {b["id"]: b for b in json.load(resp)["backends"]}


@pytest.mark.timeout(400)
@pytest.mark.skipif(not os.environ.get("KAPPA_LIVE_TRUTH"), reason=(
    "a 150 s live replay whose measured figures are not yet stable (1 of 3 runs at these settings in session 13 read b200-b's pool "
    "link at 5.1x from 2-3 requests: issue 29 open); run it with KAPPA_LIVE_TRUTH=1"))
def test_the_gateway_measures_a_fleet_that_is_not_what_its_config_says() -> None:
    trace = real_trace_path("mooncake")
    if not trace.is_file():
        pytest.skip(f"the real Mooncake trace is not at {trace}")
    catalog = default_catalog()
    truth = on_free_ports(load_settings(CONFIG_DIR / "fleet.local.truth.yaml", catalog, env={}))
    told = load_settings(DEFAULT_CONFIG, catalog, env={})
    moved = {b.id: {"url": b.url, "kv_events": b.kv_events} for b in truth.backends}  # the mocks' free ports
    told = told.model_copy(update={"backends": [b.model_copy(update=moved[b.id]) for b in told.backends]})
    engines = {b.id: build_backend_app(truth, b, catalog).state.engine.backend for b in truth.backends}
    profiles = {b.id: told.backend_spec(catalog, b) for b in told.backends}
    app = create_app(told, registry=CollectorRegistry())
    with mock_fleet(truth, time_scale=DEFAULT_TIME_SCALE), serve_in_thread(app) as url:
        results = asyncio.run(replay(load_trace(trace, limit=REQUESTS), url=url, model=told.served_models()[0],
                                     speedup=1.0, concurrency=512, progress=False))
        # four mocks in one process on a shared machine: a request or two may fail (not measured, not fatal)
        assert sum(r.error is not None for r in results) <= REQUESTS // 100
        def all_measured() -> dict[str, dict] | None:
            current = backends(url)
            return current if all("time_ratio" in b["kappa_fit"]["factors"]["compute"] for b in current.values()) else None

        measured = poll(all_measured, "every backend's compute measured", timeout_s=10.0)
    for backend_id, real in engines.items():
        b, told_spec = measured[backend_id], profiles[backend_id]
        true = {"compute": told_spec.c_eff_flops_per_s / real.c_eff_flops_per_s,
                "host_link": told_spec.link_bytes_per_s / real.link_bytes_per_s,
                "kv_pool_link": told_spec.kv_pool_link_bytes_per_s / real.kv_pool_link_bytes_per_s,
                "hbm": told_spec.hbm_bandwidth_bytes_per_s / real.hbm_bandwidth_bytes_per_s}
        factors = b["kappa_fit"]["factors"]
        found = {name: factors[name]["time_ratio"] for name in FACTORS if "time_ratio" in factors[name]}
        print(f"{backend_id}: measured {({k: round(v, 3) for k, v in found.items()})} true "
              f"{({k: round(true[k], 3) for k in found})}; κ_crit host {b['kappa_crit_linear_measured']} "
              f"(true {crossover(real, pool=False):.4g}), pool {b['kappa_fit'].get('kappa_crit_linear_kv_pool_measured')} "
              f"(true {crossover(real, pool=True):.4g})")
        for name, value in found.items():
            assert value == pytest.approx(true[name], rel=0.10), (backend_id, name)
        for key, pool in (("kappa_crit_linear_measured", False), ("kappa_crit_linear_kv_pool_measured", True)):
            value = b[key] if key in b else b["kappa_fit"].get(key)
            if value is not None:
                assert value == pytest.approx(crossover(real, pool=pool), rel=0.15), (backend_id, key)
