"""Issue 30 end to end: mocks tokenising with the shipped Hugging Face tokenizer and publishing vLLM's
KV events (one in the map encoding, one positional), a real gateway with the same tokenizer
subscribed to both, and the official `openai` client. The K the router sees for a follow-up turn
is the engine's own count of cached blocks, by value."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest
from prometheus_client import CollectorRegistry

from fleet_config import default_catalog
from mock_vllm.app_factory import build_backend_app, standalone_settings
from mock_vllm.kv_events_config import KvEventsConfig
from tests.integration.gateway_support import MOCK_MODEL, backend_doc, poll, run_gateway
from tests.support.redis_server import free_port
from tests.support.uvicorn_thread import serve_in_thread
from tokenization import EngineTokenizer, request_token_ids

pytestmark = pytest.mark.integration

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "assets" / "tokenizers" / "kappa-mock-bpe"
BLOCK = 16  # the mocks' engine block (vLLM's default)
# A system prompt above the gateway's inline-tokenising size, so the worker-thread path runs too.
SYSTEM = " ".join(f"Rule {i}: answer in plain words and cite the section you used." for i in range(120))


@contextmanager
def mocks_with_events(tok: EngineTokenizer) -> Iterator[list[tuple[str, str, str]]]:
    """Two mocks publishing KV events: ``[(url, endpoint, replay_endpoint)]``; the first in the map
    encoding (current vLLM), the second positional (older vLLM)."""
    catalog = default_catalog()
    settings, entry = standalone_settings(MOCK_MODEL, "h100-sxm", catalog, host_tier_gb=16.0)
    with ExitStack() as stack:
        out = []
        for encoding in ("map", "positional"):
            pub, replay = free_port(), free_port()
            events = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub}",
                                    replay_endpoint=f"tcp://127.0.0.1:{replay}", encoding=encoding, bind=True)
            app = build_backend_app(settings, entry, catalog, time_scale=0.001, registry=CollectorRegistry(),
                                    kv_events=events, tokenizer=tok)
            out.append((stack.enter_context(serve_in_thread(app)), f"tcp://127.0.0.1:{pub}",
                        f"tcp://127.0.0.1:{replay}"))
        yield out


def kv_view(http, backend_id: str) -> dict:
    return next(b for b in http.get("/v1/kappa/backends").json()["backends"] if b["id"] == backend_id)["kv_events"]


def test_a_follow_up_turn_routes_on_the_engines_own_cached_blocks() -> None:
    tok = EngineTokenizer.from_dir(TOKENIZER_DIR)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is rule 7?"}]
    with mocks_with_events(tok) as mocks:
        backends = [backend_doc(f"b{i}", url, kv_events={"endpoint": ep, "replay_endpoint": rep})
                    for i, (url, ep, rep) in enumerate(mocks)]
        models = {MOCK_MODEL: {"profile": MOCK_MODEL, "tokenizer": str(TOKENIZER_DIR)}}
        with run_gateway(backends, models=models) as gw:
            for b in ("b0", "b1"):
                poll(lambda b=b: kv_view(gw.http, b)["mode"] == "exact", f"{b} exact")
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(model=MOCK_MODEL, messages=first, max_tokens=8)
            answer = raw.parse()
            chosen = raw.headers["x-kappa-backend"]
            first_ids = request_token_ids(tok, {"messages": first}, chat=True)
            assert answer.usage.prompt_tokens == len(first_ids)  # the mock tokenised as the gateway does
            full_blocks = len(first_ids) // BLOCK
            poll(lambda: kv_view(gw.http, chosen)["exact_blocks"]["hbm"] >= full_blocks, "the prompt's blocks announced")

            second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "And rule 8?"}]
            plan = gw.http.post("/v1/kappa/route", json={"model": MOCK_MODEL, "messages": second, "max_tokens": 8})
            assert plan.status_code == 200, plan.text
            body = plan.json()
            by_backend = {c["backend"]: c for c in body["candidates"]}
            second_ids = request_token_ids(tok, {"messages": second}, chat=True)
            assert body["prompt_tokens_estimate"] == len(second_ids)  # counted by the engines' tokenizer
            # The engine caches the first turn's full blocks: exactly those, not an estimate from bytes.
            assert by_backend[chosen]["cached_hbm_tokens"] == full_blocks * BLOCK
            other = "b1" if chosen == "b0" else "b0"
            assert by_backend[other]["cached_hbm_tokens"] == 0
            # And the engine agrees when the turn is sent.
            again = client.chat.completions.with_raw_response.create(model=MOCK_MODEL, messages=second, max_tokens=8)
            assert again.headers["x-kappa-backend"] == chosen
            assert again.parse().usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK
