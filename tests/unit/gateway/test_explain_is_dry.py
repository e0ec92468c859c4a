"""Explaining a decision (POST /v1/kappa/route) must not change the next real one."""

from __future__ import annotations

import json

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


def _chat(*contents: str) -> bytes:
    messages = [{"role": "system", "content": "Be brief. " * 30}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{c} " * 60} for i, c in enumerate(contents)]
    return json.dumps({"model": "llama-3.1-8b", "messages": messages}).encode()


async def test_explaining_an_invalidation_records_nothing() -> None:
    """The explain route's finding is a dry run: the detector and the counter stay as they were (issue 27)."""
    doc = {"backends": [{"id": "a", "url": "http://127.0.0.1:9001", "model": "llama-3.1-8b", "hardware": "h100-sxm"}]}
    settings = parse_settings(doc, default_catalog(), env={})
    earlier = _chat("q0", "a0", "q1", "a1", "q2")
    window = _chat("q1", "a1", "q2", "a2", "q3")  # the oldest pair dropped: a sliding window
    async with routing_service(settings) as svc:
        assert svc.invalidation(svc.parse("completion", b'{"model": "llama-3.1-8b", "prompt": "x"}')) is None
        assert svc.invalidation(svc.parse("chat", earlier)).cause is None
        explained = [svc.invalidation(svc.parse("chat", window), dry_run=True) for _ in range(3)]
        assert {f.cause for f in explained} == {"front_truncation"} and len(set(explained)) == 1
        counter = svc.telemetry.invalidated_tokens.labels("llama-3.1-8b", "front_truncation")
        assert counter._value.get() == 0 and len(svc.live_invalidation.detector) == 1
        real = svc.invalidation(svc.parse("chat", window))
        assert real == explained[0] and counter._value.get() == real.invalidated_tokens > 0
