"""Real mocks publishing KV events under a real gateway, and the check that the gateway's exact index
holds what the engine holds, by value (issue 30's fault tests).

The engine's side is the mock's ``GET /kappa/kv_events/blocks``: its resident cached blocks (HBM and
host tier) by the hashes its events use, and the publisher's ``next_seq``, read in one step of its
loop. The gateway's side is its memory exact index (`MemoryEngineIndex.held`): engine hash -> copies
per tier. They agree when the subscriber is ``exact`` at ``last_seq == next_seq - 1`` and the index
holds every resident block, one copy each, and nothing else.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from mock_vllm.engine import MockEngine
from mock_vllm.kv_events import KvEventsConfig
from mock_vllm.server import create_app
from mock_vllm.types import EngineConfig
from prefix_index.engine_events import Tier
from router.capacity import kv_block_bytes
from router.cost import BackendSpec
from tests.integration.gateway_support import MOCK_MODEL, Gateway, poll
from tests.support.uvicorn_thread import serve_in_thread

BLOCK = 16
FAULTS = "/kappa/faults/kv_events"
BLOCKS = "/kappa/kv_events/blocks"
SPEC = BackendSpec(model=default_catalog().model(MOCK_MODEL), hardware=default_catalog().hw("h100-sxm"))
SYNC_TIMEOUT_S = 15.0


@dataclass
class EventMock:
    """An in-process mock publishing KV events: its URL, a client, and its ZMQ addresses."""

    url: str
    http: httpx.Client
    endpoint: str
    replay_endpoint: str

    def kv_events_entry(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint}

    def fault(self, **knobs: Any) -> dict[str, Any]:
        r = self.http.post(FAULTS, json=knobs)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, tokens: list[int]) -> None:
        r = self.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text


@contextmanager
def event_mock(*, gpu_blocks: int = 24, host_blocks: int = 8, buffer_steps: int = 10_000,
               time_scale: float = 0.001) -> Iterator[EventMock]:
    """A mock whose engine has ``gpu_blocks`` HBM blocks and ``host_blocks`` host-tier blocks (so that
    traffic evicts, offloads and reloads), publishing on ``tcp://127.0.0.1:*`` ports (the map encoding)."""
    config = EngineConfig(num_gpu_blocks_override=gpu_blocks, host_tier_bytes=host_blocks * kv_block_bytes(SPEC, BLOCK))
    events = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_steps=buffer_steps)
    app = create_app(MockEngine(SPEC, config), served_model_name=MOCK_MODEL, time_scale=time_scale,
                     registry=CollectorRegistry(), kv_events=events)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        publisher = app.state.kv_events.publisher
        yield EventMock(url, http, publisher.endpoint, publisher.replay_endpoint)


class Prompts:
    """Token-id prompts that each complete at least one new block (so each request is one batch): one of
    six shared prefixes of 0-2 blocks, then 16-24 random tokens of their own (two requests share a first
    own block with odds ~1e-60). Ids in [16, 16000): inside the shipped tokenizer's vocabulary, past its
    special tokens. Seeded: a run is repeatable."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._prefixes = [[self._rng.randrange(16, 16_000) for _ in range(BLOCK * (i % 3))] for i in range(6)]

    def next(self) -> list[int]:
        tail = [self._rng.randrange(16, 16_000) for _ in range(self._rng.randrange(BLOCK, BLOCK + 9))]
        return self._rng.choice(self._prefixes) + tail


def engine_blocks(http: httpx.Client) -> dict[str, Any]:
    r = http.get(BLOCKS)
    assert r.status_code == 200, r.text
    return r.json()


def kv_view(gw: Gateway, backend_id: str) -> dict[str, Any]:
    backends = gw.http.get("/v1/kappa/backends").json()["backends"]
    return next(b for b in backends if b["id"] == backend_id)["kv_events"]


def index_blocks(gw: Gateway, backend_id: str) -> dict[str, dict[int, int]]:
    """The gateway's exact index for a backend: ``{"GPU": {hash: copies}, "CPU": {...}}``."""
    held = gw.app.state.gateway.kv_events.index.held(MOCK_MODEL, backend_id)
    return {"GPU": held[Tier.HBM], "CPU": held[Tier.HOST]}


def index_matches_engine(gw: Gateway, http: httpx.Client, backend_id: str) -> str | None:
    """None when the index is exact and holds the engine's blocks, one copy each; else what differs."""
    engine, view = engine_blocks(http), kv_view(gw, backend_id)
    if view["mode"] != "exact" or view["last_seq"] != engine["next_seq"] - 1:
        return f"mode {view['mode']} ({view['reason']}), last_seq {view['last_seq']}, next_seq {engine['next_seq']}"
    index = index_blocks(gw, backend_id)
    for medium in ("GPU", "CPU"):
        want = dict.fromkeys(engine[medium], 1)
        if index[medium] != want:
            lost, extra = set(want) - set(index[medium]), set(index[medium]) - set(want)
            copies = {h: n for h, n in index[medium].items() if n != 1}
            return f"{medium}: {len(lost)} lost, {len(extra)} extra, copies != 1: {copies}"
    return None if engine["unnamed"] == 0 else f"{engine['unnamed']} resident blocks no event named"


def assert_index_is_engine(gw: Gateway, http: httpx.Client, backend_id: str, timeout_s: float = SYNC_TIMEOUT_S) -> None:
    """Poll until the gateway's exact index equals the engine's cache (module docstring), or fail saying how."""
    deadline = time.monotonic() + timeout_s
    while (diff := index_matches_engine(gw, http, backend_id)) is not None:
        assert time.monotonic() < deadline, f"the exact index of {backend_id} is not the engine's: {diff}"
        time.sleep(0.02)  # poll interval
    engine = engine_blocks(http)
    assert engine["GPU"], "the engine holds no block: the check would be empty"


@dataclass
class Traffic:
    """Requests sent through the gateway, counted by status (a connection error counts as ``"error"``)."""

    gw: Gateway
    statuses: Counter = field(default_factory=Counter)
    backends: Counter = field(default_factory=Counter)

    def send(self, tokens: list[int]) -> int | str:
        try:
            r = self.gw.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": tokens, "max_tokens": 1})
        except httpx.HTTPError as exc:
            self.statuses["error"] += 1
            return type(exc).__name__
        self.statuses[r.status_code] += 1
        self.backends[r.headers.get("x-kappa-backend")] += 1
        return r.status_code

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status == "error" or not 200 <= status < 300)


def wait_exact(gw: Gateway, backend_id: str, timeout_s: float = SYNC_TIMEOUT_S) -> None:
    poll(lambda: kv_view(gw, backend_id)["mode"] == "exact", f"{backend_id} exact", timeout_s=timeout_s)
