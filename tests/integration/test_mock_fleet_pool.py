"""``mock_fleet`` over real HTTP on 127.0.0.1: with a ``kv_pool`` section its mocks share one KV pool.

Two llama-3.1-8b mocks (H100 and B200) on free loopback ports, started as `mock_fleet`
starts them for ``kappa-gateway mock-fleet`` (child processes; readiness polled on
/health). A long prompt prefilled on mock A is then found by mock B in the pool, loaded
rather than recomputed; without the section B computes it all.
"""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet_config.catalog import default_catalog
from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port
from fleet_config.settings import Settings, parse_settings

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
TIME_SCALE = 0.01
PROMPT = " ".join(f"pooled{i}" for i in range(1_500))  # 3,500 tokens in the mock's tokenizer


def fleet_settings(*, kv_pool: bool) -> Settings:
    backends = [{"id": bid, "url": f"http://127.0.0.1:{free_port()}", "model": MODEL, "hardware": hardware}
                for bid, hardware in (("a", "h100-sxm"), ("b", "b200"))]
    doc = {"gateway": {"port": free_port()}, "backends": backends}
    if kv_pool:
        doc["kv_pool"] = {"capacity_gb": 50.0}
    return parse_settings(doc, default_catalog(), env={})


def chat(http: httpx.Client, url: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    response = http.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]


def metric(http: httpx.Client, url: str, name: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(http.get(f"{url}/metrics").text)
               for s in family.samples if s.name == name)


@pytest.mark.parametrize("kv_pool", [True, False], ids=["kv-pool", "no-pool"])
def test_second_mock_loads_the_first_mocks_prefix_only_with_a_pool(kv_pool: bool) -> None:
    settings = fleet_settings(kv_pool=kv_pool)
    a, b = (backend.url for backend in settings.backends)
    with mock_fleet(settings, time_scale=TIME_SCALE) as mocks, httpx.Client(timeout=30) as http:
        assert len(mocks) == (1 if kv_pool else 2)  # one process for the pooled fleet
        first = chat(http, a)
        second = chat(http, b)
        assert first["prompt_tokens"] > 3_000 and first["prompt_tokens_details"]["cached_tokens"] == 0
        kv_pool_bytes = metric(http, b, "mock_vllm:kv_pool_loaded_bytes_total")
        if kv_pool:
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached == (second["prompt_tokens"] - 1) // 16 * 16
            assert kv_pool_bytes == cached * 131_072  # B_kv of Llama-3.1-8B, bytes per token
            assert metric(http, b, "vllm:external_prefix_cache_hits_total") == cached
        else:
            assert second["prompt_tokens_details"]["cached_tokens"] == 0
            assert kv_pool_bytes == 0
        assert metric(http, a, "mock_vllm:kv_pool_loaded_bytes_total") == 0


def test_pooled_fleet_start_up_failure_names_the_backends() -> None:
    settings = fleet_settings(kv_pool=True)
    taken = settings.backends[1].url
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(taken.rsplit(":", 1)[1])))
        sock.listen()
        with pytest.raises(RuntimeError, match=taken), mock_fleet(settings, time_scale=TIME_SCALE):
            pass
