"""The index corrects itself from evidence (issue 13, item 3), with real mocks and a real gateway on 127.0.0.1.

* ``POST /reset_prefix_cache`` empties a backend without a trace in vLLM's metrics: its
  answers then report 0 cached tokens where the index credited thousands, and after three
  such answers the gateway forgets the backend (before, the credit stayed for good).
* A backend restarted in place, faster than the health interval: the scrape sees its new
  process start time and the index forgets it.
* ``kappa-gateway mock-fleet`` restarted (its mocks and their shared KV pool, one process):
  every backend's restart is seen, and the pool's entries go too (before, a 35k-token
  request was priced as a pool load, κ_ratio 308.9, on a backend that then reported 0
  cached tokens).

Records, forgets and scrapes run off the request path: the tests poll for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from fleet_config.settings import parse_settings
from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port
from mock_vllm.app_factory import build_backend_app, standalone_settings
from prefix_index import KV_POOL_ID
from tests.integration.gateway_support import (
    MOCK_MODEL,
    Gateway,
    backend_doc,
    poll,
    redis_index,
    run_gateway,
    run_mocks,
)
from tests.support.uvicorn_thread import serve_in_thread

pytestmark = pytest.mark.integration

FLEET_TIME_SCALE = 0.01
RESTART_TIMEOUT_S = 30.0  # a mock-fleet process starting again on a loaded 2-core machine


def long_prompt() -> str:
    """About 3,500 tokens in the mock's tokenizer, unlike any other prompt from its first block on."""
    return uuid.uuid4().hex + " " + " ".join(f"truth{i}" for i in range(1_500))


def credit(gw: Gateway, prompt: str) -> dict[str, dict[str, int]] | None:
    """Backend id -> the cached tokens the gateway would credit by tier (None while it cannot route)."""
    resp = gw.http.post("/v1/kappa/route", json={"model": MOCK_MODEL, "prompt": prompt, "max_tokens": 1})
    if resp.status_code != 200:
        return None
    return {c["backend"]: {tier: c[f"cached_{tier}_tokens"] for tier in ("hbm", "host", "kv_pool")}
            for c in resp.json()["candidates"]}


def credited(gw: Gateway, prompt: str) -> int | None:
    """All the cached tokens credited over every backend and tier (None while it cannot route)."""
    tiers = credit(gw, prompt)
    return None if tiers is None else sum(sum(t.values()) for t in tiers.values())


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def index(request: pytest.FixtureRequest) -> Iterator[dict]:
    """The gateway's ``index`` section: a fresh in-memory index, or Redis under a new key prefix."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    with redis_index(request.getfixturevalue("redis_url"), request.getfixturevalue("key_prefix")) as section:
        yield section


def test_reset_prefix_cache_drops_the_backends_credit_within_three_requests(index: dict) -> None:
    prompts = [long_prompt() for _ in range(4)]
    with run_mocks(1) as urls, run_gateway([backend_doc("a", urls[0])], index=index) as gw, \
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client, \
            httpx.Client(base_url=urls[0]) as mock:

        def cached_tokens(prompt: str) -> int:
            usage = client.completions.create(model=MOCK_MODEL, prompt=prompt, max_tokens=1).usage
            assert usage is not None and usage.prompt_tokens_details is not None
            return usage.prompt_tokens_details.cached_tokens or 0

        for prompt in prompts:
            assert cached_tokens(prompt) == 0
        poll(lambda: all(credited(gw, p) for p in prompts), "the index to record the four prompts")
        assert mock.post("/reset_prefix_cache").status_code == 200
        for prompt in prompts[:3]:  # each credited ~3,500 tokens, each answered with none
            assert cached_tokens(prompt) == 0
        poll(lambda: gw.metric("gateway_index_resets_total", backend="a", reason="cached-tokens-shortfall") == 1,
             "the gateway to forget the reset backend")
        assert credited(gw, prompts[3]) == 0  # never sent since the reset: its credit is gone
        poll(lambda: credited(gw, prompts[2]), "the answering request's chain to be recorded again")
        assert gw.metric("gateway_index_predictions_total", backend="a", outcome="over") == 3
        assert gw.metric("gateway_index_predictions_total", backend="a", outcome="within_one_block") == 4
        assert cached_tokens(prompts[2]) > 3_000  # and it was right to: the backend has it


@contextmanager
def mock_on_port(port: int) -> Iterator[str]:
    """A fresh mock (empty cache, new process start time) serving on ``port``."""
    catalog = default_catalog()
    settings, entry = standalone_settings(MOCK_MODEL, "h100-sxm", catalog, host_tier_gb=16.0)
    app = build_backend_app(settings, entry, catalog, time_scale=0.001, registry=CollectorRegistry())
    with serve_in_thread(app, port=port) as url:
        yield url


def test_a_backend_restarted_faster_than_the_health_interval_is_forgotten() -> None:
    port = free_port()
    prompt = long_prompt()
    with ExitStack() as stack:
        first_mock = stack.enter_context(ExitStack())
        url = first_mock.enter_context(mock_on_port(port))
        gw = stack.enter_context(run_gateway([backend_doc("a", url)],
                                             gateway={"health_interval_s": 60.0, "scrape_interval_s": 0.05}))
        assert gw.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": prompt,
                                                     "max_tokens": 1}).status_code == 200
        poll(lambda: credited(gw, prompt), "the index to record the prompt")
        first_mock.close()
        stack.enter_context(mock_on_port(port))  # a restart in place, with no health check in between
        poll(lambda: gw.metric("gateway_index_resets_total", backend="a", reason="restart") == 1,
             "the scrape to see the restart")
        assert credited(gw, prompt) == 0
        assert gw.metric("gateway_backend_up", backend="a") == 1  # no health check saw it go


def test_a_restarted_mock_fleet_takes_its_kv_pools_entries_with_it() -> None:
    backends = [backend_doc(bid, f"http://127.0.0.1:{free_port()}", hw) for bid, hw in (("a", "h100-sxm"),
                                                                                         ("b", "b200"))]
    kv_pool = {"capacity_gb": 50.0}
    fleet = parse_settings({"backends": backends, "kv_pool": kv_pool}, default_catalog(), env={})
    prompt = long_prompt()
    with ExitStack() as stack:
        first_fleet = stack.enter_context(ExitStack())
        first_fleet.enter_context(mock_fleet(fleet, time_scale=FLEET_TIME_SCALE))
        gw = stack.enter_context(run_gateway(backends, kv_pool=kv_pool))
        assert gw.http.post("/v1/completions", json={"model": MOCK_MODEL, "prompt": prompt,
                                                     "max_tokens": 1}).status_code == 200
        # The backend that did not serve it is credited the pool's copy.
        poll(lambda: any(t["kv_pool"] > 3_000 for t in (credit(gw, prompt) or {}).values()),
             "the index to record the prompt on its backend and in the pool")
        first_fleet.close()  # the fleet stops: mocks and pool
        stack.enter_context(mock_fleet(fleet, time_scale=FLEET_TIME_SCALE))  # and starts again, same ports
        poll(lambda: gw.metric("gateway_index_resets_total", backend=KV_POOL_ID,
                               reason="kv-pool-backends-restarted") == 1,
             "the gateway to forget the pool", timeout_s=RESTART_TIMEOUT_S)
        assert gw.metric("gateway_index_resets_total", reason="restart") == 2
        assert poll(lambda: credited(gw, prompt) == 0, "both backends to route again")
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as client:
            raw = client.completions.with_raw_response.create(model=MOCK_MODEL, prompt=prompt, max_tokens=1)
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 0  # the truth, as the gateway now expects
        assert float(raw.headers["x-kappa-ratio"]) == 0.0 and raw.headers["x-kappa-regime"] == "compute"
