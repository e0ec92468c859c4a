"""The gateway over a fleet-shared KV pool, end to end on 127.0.0.1, with each index backend.

Two llama-3.1-8b mocks (H100 and B200) share one pool (`gateway.commands.fleet.mock_fleet`, one
child process); a real uvicorn gateway with the same ``kv_pool`` section routes to them.
Once a long prompt has run on one backend, the index holds its chain for that backend and
for the pool (`prefix_index.KV_POOL_ID`), so the gateway expects the other backend to load it
from the pool, and the other mock does. Without the section none of it appears. Records
land after the first byte, asynchronously: the tests poll for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.integration.gateway_support import (
    MOCK_MODEL,
    Gateway,
    backend_doc,
    poll,
    redis_index,
    run_gateway,
    run_mocks,
    run_pooled_mocks,
)

pytestmark = pytest.mark.integration

KV_POOL = {"capacity_gb": 50.0}
HARDWARE = ["h100-sxm", "b200"]


@pytest.fixture(scope="module")
def pooled_urls() -> Iterator[list[str]]:
    """The pooled mocks, shared by the module: every test sends its own prompt (`prompt`)."""
    with run_pooled_mocks(HARDWARE, KV_POOL) as urls:
        yield urls


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def index(request: pytest.FixtureRequest) -> Iterator[dict]:
    """The gateway's ``index`` section: a fresh in-memory index, or Redis under a new key prefix."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    with redis_index(request.getfixturevalue("redis_url"), request.getfixturevalue("key_prefix")) as section:
        yield section


@pytest.fixture
def prompt() -> str:
    """About 3,500 tokens in the mock's tokenizer, unlike any other test's from its first block on."""
    return uuid.uuid4().hex + " " + " ".join(f"pooled{i}" for i in range(1_500))


@contextmanager
def ready_gateway(urls: list[str], index: dict, **sections: dict) -> Iterator[Gateway]:
    """A gateway over ``urls`` as backends a (H100) and b (B200), once both are healthy."""
    backends = [backend_doc(bid, url, hw) for bid, url, hw in zip("ab", urls, HARDWARE, strict=True)]
    with run_gateway(backends, index=index, **sections) as gw:
        poll(lambda: gw.http.get("/ready").json()["healthy_backends"] == 2, "both backends healthy")
        yield gw


def openai_client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-test", max_retries=0, timeout=30)


def chat_body(prompt: str) -> dict:
    return {"model": MOCK_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}


def explain(gw: Gateway, body: dict) -> tuple[dict, dict[str, dict]]:
    """POST /v1/kappa/route: the whole answer and its candidates by backend id."""
    out = gw.http.post("/v1/kappa/route", json=body).json()
    return out, {c["backend"]: c for c in out["candidates"]}


def explain_once(gw: Gateway, body: dict, ready: Callable[[dict[str, dict]], bool]) -> tuple[dict, dict[str, dict]]:
    """`explain`, polled until ``ready(candidates)``: a record lands after the first byte, asynchronously."""
    def answer() -> tuple[dict, dict[str, dict]] | None:
        out, candidates = explain(gw, body)
        return (out, candidates) if ready(candidates) else None
    return poll(answer, "the index record")


def test_other_backend_is_offered_the_prompt_from_the_pool(pooled_urls: list[str], index: dict, prompt: str) -> None:
    with ready_gateway(pooled_urls, index, kv_pool=KV_POOL) as gw, openai_client(gw) as client:
        raw = client.chat.completions.with_raw_response.create(**chat_body(prompt))
        prompt_tokens = raw.parse().usage.prompt_tokens
        assert prompt_tokens > 3_000
        x = raw.headers["x-kappa-backend"]
        (other,) = {"a", "b"} - {x}
        out, candidates = explain_once(gw, chat_body(prompt),
                                       lambda c: c[x]["cached_hbm_tokens"] and c[other]["cached_kv_pool_tokens"])
        block_tokens = out["tokens_per_block_estimate"]
        assert abs(candidates[other]["cached_kv_pool_tokens"] - prompt_tokens) <= block_tokens
        assert candidates[other]["cached_hbm_tokens"] == candidates[other]["cached_host_tokens"] == 0
        assert abs(candidates[x]["cached_hbm_tokens"] - prompt_tokens) <= block_tokens
        assert candidates[x]["cached_kv_pool_tokens"] == 0

        listed = gw.http.get("/v1/kappa/backends").json()
        assert listed["kv_pool"] == {"capacity_bytes": 50e9, "cached_blocks": out["prompt_blocks"]}
        backends = {b["id"]: b for b in listed["backends"]}
        assert backends[x]["cached_blocks"] == out["prompt_blocks"] and backends[other]["cached_blocks"] == 0
        assert all(b["kv_pool_link_bytes_per_s"] > 0 for b in backends.values())


def test_round_robin_sends_the_repeat_to_the_other_backend_which_loads_it_from_the_pool(
        pooled_urls: list[str], index: dict, prompt: str) -> None:
    with ready_gateway(pooled_urls, index, kv_pool=KV_POOL, routing={"policy": "round-robin"}) as gw, \
            openai_client(gw) as client:
        first = client.chat.completions.with_raw_response.create(**chat_body(prompt))
        assert first.headers["x-kappa-backend"] == "a"  # the rotation starts at the first backend
        assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
        # Not /v1/kappa/route: explaining a decision turns the rotation too.
        poll(lambda: gw.http.get("/v1/kappa/backends").json()["kv_pool"]["cached_blocks"], "the pool's record")

        second = client.chat.completions.with_raw_response.create(**chat_body(prompt))
        assert second.headers["x-kappa-backend"] == "b"
        assert float(second.headers["x-kappa-ratio"]) > 1
        loaded = second.parse().usage.prompt_tokens_details.cached_tokens  # b never saw it: all from the pool
        estimated = gw.metric("gateway_prompt_tokens_total", backend="b", source="cached_kv_pool")
        assert loaded > 3_000 and estimated > 3_000
        block_tokens = explain(gw, chat_body(prompt))[0]["tokens_per_block_estimate"]
        assert abs(loaded - estimated) <= max(block_tokens, 16)  # one index block, or one vLLM block
        assert gw.metric("gateway_prompt_tokens_total", source="cached_hbm") == 0
        assert gw.metric("gateway_prompt_tokens_total", backend="a", source="cached_kv_pool") == 0


def test_without_a_kv_pool_section_the_other_backend_has_nothing_to_load(index: dict, prompt: str) -> None:
    with run_mocks(2) as urls, ready_gateway(urls, index) as gw, openai_client(gw) as client:
        raw = client.chat.completions.with_raw_response.create(**chat_body(prompt))
        x = raw.headers["x-kappa-backend"]
        (other,) = {"a", "b"} - {x}
        _, candidates = explain_once(gw, chat_body(prompt), lambda c: c[x]["cached_hbm_tokens"])
        assert candidates[other]["cached_kv_pool_tokens"] == 0 and candidates[other]["cached_hbm_tokens"] == 0
        assert candidates[x]["cached_kv_pool_tokens"] == 0
        listed = gw.http.get("/v1/kappa/backends").json()
        assert listed["kv_pool"] is None
        assert all(b["kv_pool_link_bytes_per_s"] is None for b in listed["backends"])
        assert gw.metric("gateway_prompt_tokens_total", source="cached_kv_pool") == 0
