"""Two-phase P/D flows against real mock servers (`mock_vllm.pd`), shared by the P/D tests.

A small fleet of llama-3.1-8b mocks (B_kv 131,072 bytes/token: a 16-token block is 2 MiB) with a
50 GB/s, 0.5 ms RDMA default link; prompts are token ids (``/v1/completions``), so block counts
are exact. `phases` runs the gateway's two requests the way vLLM's toy proxy does.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from fleet_config import Settings, default_catalog, parse_settings
from mock_vllm.app_factory import engine_config, pd_settings
from mock_vllm.engine import MockEngine
from mock_vllm.server import create_app
from tests.support.uvicorn_thread import serve_in_thread

MODEL = "llama-3.1-8b"
BLOCK = 16
BLOCK_BYTES = BLOCK * 131_072
TIME_SCALE = 0.01
LINK_GB_S, LINK_LATENCY_S = 50.0, 0.0005
CATALOG = default_catalog()
# What the toy proxy sends a prefill instance (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def fleet(*backends: dict[str, Any]) -> Settings:
    return parse_settings({"models": {MODEL: {"profile": MODEL}},
                           "interconnect": {"default": {"bandwidth_gb_s": LINK_GB_S, "latency_s": LINK_LATENCY_S}},
                           "backends": list(backends)}, CATALOG, env={})


def backend(backend_id: str, role: str, port: int, hardware: str = "h100-sxm") -> dict[str, Any]:
    return {"id": backend_id, "url": f"http://127.0.0.1:{port}", "model": MODEL, "hardware": hardware, "kv_role": role}


@dataclass
class Mock:
    url: str
    app: Any
    http: httpx.Client
    client: openai.OpenAI

    @property
    def engine(self) -> MockEngine:
        return self.app.state.engine

    def metric(self, sample: str, **labels: str) -> float:
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise KeyError(sample)

    def transfer_figures(self) -> tuple[float, float, float]:
        """(bytes, seconds, transfers) the NIXL histograms have summed so far."""
        return (self.metric("vllm:nixl_bytes_transferred_sum"), self.metric("vllm:nixl_xfer_time_seconds_sum"),
                self.metric("vllm:nixl_xfer_time_seconds_count"))


@contextmanager
def serve(settings: Settings, backend_id: str, **pd: Any) -> Iterator[Mock]:
    """A mock of ``backend_id`` on a free port, with P/D settings overridden by ``pd``."""
    entry = next(b for b in settings.backends if b.id == backend_id)
    engine = MockEngine(settings.backend_spec(CATALOG, entry), engine_config(entry))
    app = create_app(engine, served_model_name=MODEL, time_scale=TIME_SCALE,
                     pd=replace(pd_settings(settings, entry), **pd))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield Mock(url, app, http, client)


def prompt(tokens: int) -> list[int]:
    """Fresh token ids (a seeded draw per call, so tests never share a prefix by accident)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1000, 30000) for _ in range(tokens)]


def complete(mock: Mock, ids: list[int], *, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, **extra}
    return mock.http.post("/v1/completions", json=body)


def prefill(p: Mock, ids: list[int]) -> dict[str, Any]:
    """The first phase: returns the ``kv_transfer_params`` p answered with."""
    resp = complete(p, ids, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def expected_transfer_s(num_bytes: float, gb_s: float = LINK_GB_S) -> float:
    return LINK_LATENCY_S + num_bytes / (gb_s * 1e9)
