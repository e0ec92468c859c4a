"""The gateway and the simulator route by one pipeline: same requests, same clock, same decisions.

The same request sequence goes (a) through the gateway's routing — the real body parsed and
hashed by `gateway.routing.RoutingService`, its `BackendSet` states scraped as the mocks
would report, planned and charged — and (b) through the simulator, whose backends are mock
engines. Every request arrives at t = 0 (a frozen clock: nothing finishes in between), so
each decision sees the ledger charges, in-flight chains and round-robin turn the earlier ones
left. Both must give the same views and the same ranking for every request and policy.
"""

from __future__ import annotations

import random

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from dispatch import BackendMetrics
from fleet_config import CONFIG_DIR, KvPoolSection, default_catalog, load_settings
from gateway.backends.backend_set import BackendSet
from gateway.backends.backend_state import BackendState
from gateway.routing import RoutingService
from gateway.telemetry.metrics import Telemetry
from mock_vllm.app_factory import engine_config
from mock_vllm.engine import MockEngine
from prefix_index import MemoryPrefixIndex
from router.calibration import BytesPerToken
from router.policies import POLICY_NAMES, build_policy
from sim.fleet import fleet_from_settings
from sim.prompts import _CANONICAL_HEAD, _CANONICAL_TAIL, canonical_bytes, prepare_trace
from sim.simulator import DecisionEvent, simulate
from sim.traces import TraceRequest
from sim.workloads import mooncake_like

CATALOG = default_catalog()
SEED = 11


def settings_with_pool():
    """The heterogeneous fleet with a shared KV pool, so the pool overlay is exercised too."""
    settings = load_settings(CONFIG_DIR / "fleets" / "heterogeneous.yaml", CATALOG, env={})
    return settings.model_copy(update={"kv_pool": KvPoolSection(capacity_gb=500.0)})


def frozen_requests() -> list[TraceRequest]:
    """40 Mooncake-shaped requests (shared system prompt, multi-turn prefixes), all at t = 0."""
    reqs = mooncake_like(40, rate_rps=2.0, seed=3, max_input_tokens=20_000)
    return [TraceRequest(0.0, r.input_tokens, r.output_tokens, r.hash_ids) for r in reqs]


def sim_decisions(settings, policy: str, requests: list[TraceRequest]):
    """The simulator's decisions (by request index) and the hashes it prepared for each request."""
    fleet = fleet_from_settings(settings, CATALOG)
    prepared = prepare_trace(requests, model=fleet.served_models()[0], block_size_bytes=fleet.block_size_bytes)
    events: list[DecisionEvent] = []
    simulate(fleet, build_policy(policy, {}), prepared, seed=SEED, observer=events.append)
    return sorted(events, key=lambda e: e.request_index), [list(p.hashes) for p in prepared]


async def gateway_decisions(settings, policy: str, requests: list[TraceRequest]):
    """Plan and charge each request as the proxy does, on backends scraped as the mocks report."""
    states = []
    for entry in settings.backends:
        spec = settings.backend_spec(CATALOG, entry)
        state = BackendState.of(entry, spec, healthy=True)
        engine = MockEngine(spec, engine_config(entry))  # what its /metrics says before any request
        state.metrics = BackendMetrics(num_gpu_blocks=engine.stats.num_gpu_blocks,
                                       block_size_tokens=engine.block_size)
        states.append(state)
    telemetry = Telemetry(CollectorRegistry())
    model = settings.served_models()[0]
    plans = []
    async with aiohttp.ClientSession() as session:
        backends = BackendSet(states, session, telemetry, on_restart=_ignore, health_interval_s=1, scrape_interval_s=1)
        routing = RoutingService(settings, backends, MemoryPrefixIndex(), build_policy(policy, {}), telemetry,
                                 BytesPerToken(default=settings.index.bytes_per_token), random.Random(SEED),
                                 clock=lambda: 0.0)
        for i, req in enumerate(requests):
            text = canonical_bytes(req, i).removeprefix(_CANONICAL_HEAD).removesuffix(_CANONICAL_TAIL)
            body = {"model": model, "messages": [{"role": "user", "content": text.decode()}],
                    "max_tokens": max(req.output_tokens, 1)}
            plan = await routing.plan(routing.parse("chat", orjson.dumps(body)))
            routing.charge(plan, plan.decision.chosen)
            plans.append(plan)
    return plans


async def _ignore(backend_id: str) -> None:
    return None


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_the_gateway_and_the_simulator_make_identical_decisions(policy: str) -> None:
    settings = settings_with_pool()
    requests = frozen_requests()
    sim, sim_hashes = sim_decisions(settings, policy, requests)
    live = await gateway_decisions(settings, policy, requests)
    assert [e.request_index for e in sim] == list(range(len(requests))) and len(live) == len(requests)
    for event, plan in zip(sim, live, strict=True):
        assert plan.request.hashes == sim_hashes[event.request_index]  # the body hashes as the simulator's prompt
        assert plan.features == event.features
        assert plan.views == event.views, f"request {event.request_index}: the two saw different backends"
        assert plan.decision == event.decision, f"request {event.request_index}: different decisions"
    # Not trivially equal: later decisions saw the earlier ones' charges and in-flight chains.
    assert sum(view.in_flight for view in live[-1].views) == len(requests) - 1
    assert any(view.in_flight_blocks for plan in live for view in plan.views)
    assert any(view.kv_demand_bytes for view in live[-1].views)

