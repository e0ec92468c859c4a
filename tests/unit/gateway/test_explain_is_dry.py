"""Explaining a decision (POST /v1/kappa/route) must not change the next real one."""

from __future__ import annotations

from fleet_config import default_catalog, parse_settings
from gateway.routing import RoutingService
from tests.unit.gateway.routing_support import routing_service

BODY = b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello"}]}'


async def test_explaining_does_not_move_round_robins_turn() -> None:
    """Found by the pool's integration test: each explain call advanced the rotation."""
    doc = {"backends": [{"id": bid, "url": f"http://127.0.0.1:{port}", "model": "llama-3.1-8b", "hardware": "h100-sxm"}
                        for bid, port in (("a", 9001), ("b", 9002), ("c", 9003))]}
    settings = parse_settings(doc, default_catalog(), env={})

    async def chosen(svc: RoutingService, explains: int) -> list[str]:
        out = []
        for _ in range(4):
            for _ in range(explains):
                await svc.plan(svc.parse("chat", BODY), dry_run=True)
            out.append((await svc.plan(svc.parse("chat", BODY))).decision.chosen.backend_id)
        return out

    async with routing_service(settings, "round-robin", seed=7) as explained, \
            routing_service(settings, "round-robin", seed=7) as plain:
        assert await chosen(explained, explains=3) == await chosen(plain, explains=0)
