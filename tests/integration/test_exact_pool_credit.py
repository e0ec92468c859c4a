"""Issue 30: an exact backend's KV-pool credit is counted in the engines' blocks (`dispatch.exact`).

The demo fleet (``config/fleet.local.yaml``: four mocks in one process sharing a KV pool, tokenising
with the shipped tokenizer and publishing KV events) behind a real gateway. A first request puts a
system prompt's blocks in one backend's HBM and in the pool; every other backend holds nothing of it
and would load it from the pool. The gateway must credit each of them exactly the engine blocks the
pool holds of the second request: before the fix it credited the pool's *byte* blocks at the model's
calibrated bytes per token, hundreds of tokens off on a prompt whose text tokenises unlike the average
(here a first question of digits, which pulls the calibration far from the prose's rate).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from fleet_config.catalog import default_catalog
from fleet_config.settings import Settings, load_settings, parse_settings
from gateway.app import create_app
from gateway.commands.demo import DEFAULT_CONFIG, on_free_ports
from gateway.commands.fleet import mock_fleet
from tests.integration.gateway_support import Gateway, poll
from tests.support.uvicorn_thread import serve_in_thread
from tokenization import EngineTokenizer, request_token_ids

pytestmark = pytest.mark.integration

BLOCK = 16  # the mocks' engine block
CATALOG = default_catalog()
SYSTEM = " ".join(f"Rule {i}: the clerk answers every letter about the order before the end of the week, "
                  "and keeps a copy of the answer with the letter." for i in range(60))
DIGITS = " ".join(str(1_000_003 * i % 9_999_991) for i in range(700))  # tokenises at another bytes/token than prose


@pytest.fixture(scope="module")
def demo_fleet() -> Iterator[tuple[Settings, Gateway]]:
    doc = on_free_ports(load_settings(DEFAULT_CONFIG, CATALOG, env={})).model_dump(mode="json")
    doc["gateway"].update(health_interval_s=0.05, scrape_interval_s=0.05)
    settings = parse_settings(doc, CATALOG, env={})
    with mock_fleet(settings, time_scale=0.0005):
        app = create_app(settings, registry=CollectorRegistry())
        with serve_in_thread(app, proxy_headers=False) as url, httpx.Client(base_url=url, timeout=60) as http:
            gw = Gateway(url, app, http)
            poll(lambda: all(b["kv_events"]["mode"] == "exact" for b in http.get("/v1/kappa/backends").json()["backends"]),
                 "every backend exact")
            yield settings, gw


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_backends_without_the_prefix_are_credited_the_pools_engine_blocks(demo_fleet: tuple[Settings, Gateway]) -> None:
    settings, gw = demo_fleet
    tok = EngineTokenizer.from_dir(settings.models["llama-3.1-70b"].tokenizer)
    model = settings.served_models()[0]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DIGITS}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which rule covers refunds?"}]
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=first, max_tokens=4)
    holder = raw.headers["x-kappa-backend"]
    first_ids = request_token_ids(tok, {"messages": first}, chat=True)
    second_ids = request_token_ids(tok, {"messages": second}, chat=True)
    assert raw.parse().usage.prompt_tokens == len(first_ids)
    shared_tokens = _common_prefix(first_ids, second_ids) // BLOCK * BLOCK  # the system prompt's full blocks
    assert shared_tokens > 1_000
    poll(lambda: next(b for b in gw.http.get("/v1/kappa/backends").json()["backends"]
                      if b["id"] == holder)["kv_events"]["exact_blocks"]["hbm"] >= len(first_ids) // BLOCK,
         "the first prompt's blocks announced")

    def candidates() -> dict[str, dict]:
        plan = gw.http.post("/v1/kappa/route", json={"model": model, "messages": second, "max_tokens": 4})
        assert plan.status_code == 200, plan.text
        return {c["backend"]: c for c in plan.json()["candidates"]}

    def credited(c: dict) -> int:
        return c["cached_hbm_tokens"] + c["cached_host_tokens"] + c["cached_kv_pool_tokens"]

    # The pool's record is spawned at the first byte: poll until it is in (then every backend has its credit).
    by_backend = poll(lambda: (c := candidates()) and all(credited(c[b.id]) > 0 for b in settings.backends) and c,
                      "every backend credited")
    assert {b: credited(c) for b, c in by_backend.items()} == {b.id: shared_tokens for b in settings.backends}
    others = [b.id for b in settings.backends if b.id != holder]
    assert [by_backend[b]["cached_kv_pool_tokens"] for b in others] == [shared_tokens] * 3  # all from the pool
    assert by_backend[holder]["cached_hbm_tokens"] == shared_tokens  # its own HBM, from its events
    # And the engine agrees where the gateway sends the request.
    again = client.chat.completions.with_raw_response.create(model=model, messages=second, max_tokens=4)
    assert again.parse().usage.prompt_tokens_details.cached_tokens == shared_tokens
