"""Explaining a decision (POST /v1/kappa/route) must not change the next real one."""

from __future__ import annotations

import random

import aiohttp
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from gateway.backends import BackendSet, BackendState
from gateway.routing import RoutingService
from fleet_config.settings import parse_settings
from gateway.telemetry import Telemetry
from prefix_index import MemoryPrefixIndex
from router.calibration import BytesPerToken
from router.policies import build_policy

BODY = b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello"}]}'


async def test_explaining_does_not_move_round_robins_turn() -> None:
    """Found by the pool's integration test: each explain call advanced the rotation."""
    policy = "round-robin"
    catalog = default_catalog()
    doc = {"backends": [{"id": bid, "url": f"http://127.0.0.1:{port}", "model": "llama-3.1-8b", "hardware": "h100-sxm"}
                        for bid, port in (("a", 9001), ("b", 9002), ("c", 9003))]}
    settings = parse_settings(doc, catalog, env={})
    telemetry = Telemetry(CollectorRegistry())
    states = [BackendState.of(b, settings.backend_spec(catalog, b), healthy=True) for b in settings.backends]

    async def forget(backend_id: str) -> None:
        return None

    async with aiohttp.ClientSession() as session:
        backends = BackendSet(states, session, telemetry, on_restart=forget, health_interval_s=1, scrape_interval_s=1)

        def service() -> RoutingService:
            return RoutingService(settings, backends, MemoryPrefixIndex(), build_policy(policy, {}), telemetry,
                                  BytesPerToken(default=4.0), random.Random(7))

        async def chosen(svc: RoutingService, explains: int) -> list[str]:
            out = []
            for _ in range(4):
                for _ in range(explains):
                    await svc.plan(svc.parse("chat", BODY), dry_run=True)
                out.append((await svc.plan(svc.parse("chat", BODY))).decision.chosen.backend_id)
            return out

        assert await chosen(service(), explains=3) == await chosen(service(), explains=0)
