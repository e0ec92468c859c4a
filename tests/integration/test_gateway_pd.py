"""The gateway in front of a P/D fleet of real mocks (issue 26): the official `openai` client gets a
split request's answer, streamed with usage and not; a client's own ``kv_transfer_params`` is never
split; a dead prefill backend falls back to aggregated; a link that delivers a fiftieth of its figure
is marked degraded and no longer split over, and is used again once it recovers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from fleet_config import default_catalog, parse_settings
from mock_vllm.app_factory import build_backend_app
from tests.integration.gateway_support import Gateway, poll, run_gateway
from tests.support.uvicorn_thread import serve_in_thread

MODEL = "llama-3.1-8b"
CATALOG = default_catalog()
LINK = {"bandwidth_gb_s": 50, "latency_s": 0.0005, "kind": "rdma"}
# Prefill on a compute-dense B200, decode on an H100: a long uncached prompt prefills 2.25× faster on
# the B200, and its KV crosses 50 GB/s in a fraction of that (router.pd).
ROLES = (("p", "prefill", "b200"), ("d", "decode", "h100-sxm"))
LONG_PROMPT = " ".join(f"w{i}" for i in range(3000))  # ~3.4k tokens: the split pays


def docs(urls: dict[str, str], roles: tuple[tuple[str, str, str], ...] = ROLES) -> list[dict[str, Any]]:
    return [{"id": bid, "url": urls[bid], "model": MODEL, "hardware": hw, "kv_role": role} for bid, role, hw in roles]


@contextmanager
def pd_fleet(roles: tuple[tuple[str, str, str], ...] = ROLES,
             **interconnect: Any) -> Iterator[tuple[Gateway, dict[str, str]]]:
    """The mocks (knowing each other's ids and the links) and a gateway in front of them."""
    section = {"default": LINK, **interconnect}
    placeholder = {bid: f"http://127.0.0.1:{9000 + i}" for i, (bid, _, _) in enumerate(roles)}
    mock_settings = parse_settings({"models": {MODEL: {"profile": MODEL}}, "interconnect": section,
                                    "backends": docs(placeholder, roles)}, CATALOG, env={})
    with ExitStack() as stack:
        urls = {b.id: stack.enter_context(serve_in_thread(build_backend_app(
            mock_settings, b, CATALOG, time_scale=0.01, registry=CollectorRegistry()))) for b in mock_settings.backends}
        gw = stack.enter_context(run_gateway(docs(urls, roles), models={MODEL: {"profile": MODEL}}, interconnect=section))
        poll(lambda: all(b["healthy"] for b in gw.http.get("/v1/kappa/backends").json()["backends"]), "both healthy")
        yield gw, urls


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_the_official_client_gets_a_split_answer_streamed_and_not() -> None:
    with pd_fleet() as (gw, _):
        with client(gw) as c:
            raw = c.completions.with_raw_response.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=12)
            answer = raw.parse()
            assert raw.headers["x-kappa-prefill-backend"] == "p" and raw.headers["x-kappa-backend"] == "d"
            assert answer.usage.completion_tokens == 12 and answer.choices[0].text
            # vLLM's decode side counts the pulled KV as cached: all but the last prompt token.
            assert answer.usage.prompt_tokens_details.cached_tokens == answer.usage.prompt_tokens - 1

            with c.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT + " again"}], max_tokens=9,
                    stream=True, stream_options={"include_usage": True}) as stream:
                assert stream.headers["x-kappa-prefill-backend"] == "p"
                chunks = list(stream.parse())
            assert sum(len(ch.choices[0].delta.content or "") > 0 for ch in chunks if ch.choices) == 9
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
        assert gw.metric("gateway_pd_splits_total", prefill_backend="p", decode_backend="d") == 2
        explained = gw.http.post("/v1/kappa/route", json={"model": MODEL, "prompt": "fresh " + LONG_PROMPT}).json()
        split = explained["split"]
        assert (split["prefill_backend"], split["decode_backend"], explained["chosen"]) == ("p", "d", "d")
        assert split["transfer_tokens"] > 3000 and split["link"]["kind"] == "rdma"
        assert split["predicted_ttft_s"] < explained["candidates"][0]["predicted_ttft_s"]  # beats d alone


def test_a_short_prompt_is_not_split_and_a_clients_own_kv_transfer_params_never_are() -> None:
    with pd_fleet() as (gw, urls):
        short = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert short.status_code == 200 and "x-kappa-prefill-backend" not in short.headers
        own = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
        resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1,
                                                     "kv_transfer_params": own})
        assert resp.status_code == 200 and "x-kappa-prefill-backend" not in resp.headers
        assert resp.headers["x-kappa-backend"] == "d"  # whole, on the backend that decodes
        assert resp.json()["kv_transfer_params"]["do_remote_prefill"] is True  # relayed as the engine sent it
        assert gw.metric("gateway_pd_splits_total") == 0


def test_a_dead_prefill_backend_falls_back_to_aggregated() -> None:
    with pd_fleet() as (gw, urls):
        # The prefill backend's url now points at a closed port: its phase cannot connect.
        gw.app.state.gateway.backends.by_id["p"].entry = gw.app.state.gateway.backends.by_id["p"].entry.model_copy(
            update={"url": "http://127.0.0.1:9"})
        resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
        assert "x-kappa-prefill-backend" not in resp.headers and resp.headers["x-kappa-backend"] == "d"
        assert gw.metric("gateway_pd_prefill_fallbacks_total", prefill_backend="p", reason="connect-failure") == 1


def test_a_link_that_delivers_a_fiftieth_is_marked_degraded_then_used_again_once_it_recovers() -> None:
    with pd_fleet(probe_interval_s=0.5) as (gw, urls):
        with httpx.Client(base_url=urls["d"], timeout=10) as d:
            assert d.post("/kappa/faults/link", json={"peer": "p", "delivered_gb_s": 1.0}).status_code == 200
            split = 0
            for i in range(100):
                resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": f"{i} {LONG_PROMPT}",
                                                             "max_tokens": 2})
                assert resp.status_code == 200
                split += "x-kappa-prefill-backend" in resp.headers
                link = gw.http.get("/v1/kappa/backends").json()["pd_links"][0]
                if link["state"] == "degraded":
                    break
            assert link["state"] == "degraded", link
            assert split >= 3  # it judged on enough transfers (pd_links.MIN_TRANSFERS), within the 100
            assert link["delivered_bytes_per_s"] == pytest.approx(1e9, rel=0.15)
            assert gw.metric("gateway_pd_link_state", prefill_backend="p", decode_backend="d") == 1
            # Not split over while degraded.
            resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": f"after {LONG_PROMPT}",
                                                         "max_tokens": 2})
            assert "x-kappa-prefill-backend" not in resp.headers
            assert d.delete("/kappa/faults/link").status_code == 200

            probes = iter(range(10_000))

            def healthy_again() -> bool:  # fresh prompts: one d already holds would stay whole there
                gw.http.post("/v1/completions", json={"model": MODEL, "prompt": f"probe {next(probes)} {LONG_PROMPT}",
                                                      "max_tokens": 2})
                return gw.http.get("/v1/kappa/backends").json()["pd_links"][0]["state"] == "healthy"

            poll(healthy_again, "the recovered link measured healthy by a probe", timeout_s=20)
        resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": f"later {LONG_PROMPT}", "max_tokens": 2})
        assert resp.headers.get("x-kappa-prefill-backend") == "p"


def test_a_clients_own_failing_kv_transfer_is_neither_retried_nor_held_against_the_backend() -> None:
    """A client's own P/D flow whose KV lives nowhere the decode can reach (an expired prefill,
    another proxy's): the decode answers 500 (vLLM's kv_load_failure_policy 'fail'). The gateway
    relays that once, retries nothing elsewhere (the params name one KV location), counts none of
    it toward the backend's ejection, and does not blame its own link (issue 26)."""
    foreign = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "someone-elses-prefill",
               "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 9,
               "remote_request_id": "x", "tp_size": 1}
    with pd_fleet(ROLES + (("d2", "decode", "h100-sxm"),)) as (gw, _):
        for i in range(8):  # past outlier_detection's default consecutive_5xx (5)
            resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": f"{i} hello", "max_tokens": 2,
                                                         "kv_transfer_params": foreign})
            assert resp.status_code >= 500 and "error" in resp.json()
        assert gw.metric("gateway_upstream_retries_total") == 0
        assert gw.metric("gateway_outlier_ejections_total") == 0
        backends = gw.http.get("/v1/kappa/backends").json()
        assert all(b["healthy"] for b in backends["backends"])
        assert {link["state"] for link in backends["pd_links"]} == {"healthy"}
        # and the fleet still splits as before
        resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "later " + LONG_PROMPT, "max_tokens": 2})
        assert resp.headers.get("x-kappa-prefill-backend") == "p"
