"""Keys at the edge: the admin key on /v1/kappa/* (and /metrics when asked), client keys on the
proxy routes, and what goes upstream. On 65d19c0 every route answered anyone."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from fleet_config.catalog import default_catalog
from fleet_config.errors import ConfigError
from fleet_config.settings import parse_settings
from gateway.edge.auth import matches
from tests.integration.gateway_support import backend_doc, run_fakes, run_gateway
from tests.support.fake_upstream import Script

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error" and resp.json()["error"]["code"] == 401


def test_the_admin_key_from_the_environment_guards_the_kappa_routes_only() -> None:
    settings = parse_settings({"backends": [backend_doc("b0", "http://127.0.0.1:9")]}, default_catalog(),
                              env={"KAPPA_ADMIN_API_KEY": "s3cret-admin"})
    key = settings.gateway.admin_api_key
    assert key is not None and key.get_secret_value() == "s3cret-admin"
    assert "s3cret" not in repr(settings.gateway)  # a SecretStr: never printed
    with run_fakes([Script()]) as (url,), run_gateway([backend_doc("b0", url)], gateway={"admin_api_key": "k"}) as gw:
        assert_401(gw.http.get("/v1/kappa/backends"))
        assert_401(gw.http.get("/v1/kappa/backends", headers=bearer("wrong")))
        assert_401(gw.http.get("/v1/kappa/backends", headers={"authorization": "Basic k"}))
        assert gw.http.get("/v1/kappa/backends", headers=bearer("k")).status_code == 200
        assert_401(gw.http.post("/v1/kappa/route", json=BODY))
        assert gw.http.post("/v1/kappa/route", json=BODY, headers=bearer("k")).status_code == 200
        for open_path in ("/health", "/ready", "/metrics", "/v1/models"):  # probes and scrapers carry no keys
            assert gw.http.get(open_path).status_code == 200, open_path
        assert gw.http.post("/v1/chat/completions", json=BODY).status_code == 200  # no client keys configured


def test_metrics_can_be_put_behind_the_admin_key() -> None:
    with run_fakes([Script()]) as (url,), run_gateway(
            [backend_doc("b0", url)], gateway={"admin_api_key": "k", "metrics_require_admin_key": True}) as gw:
        assert_401(gw.http.get("/metrics"))
        assert "gateway_requests_total" in gw.http.get("/metrics", headers=bearer("k")).text


def test_client_keys_guard_the_proxy_routes_and_the_openai_client_sees_an_authentication_error(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n\n")
    script = Script()
    edge = {"api_keys": ["list-key"], "api_keys_file": str(key_file)}
    with run_fakes([script]) as (url,), run_gateway([backend_doc("b0", url)], gateway=edge) as gw:
        assert_401(gw.http.post("/v1/chat/completions", json=BODY))
        assert_401(gw.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=bearer("nope")))
        for key in ("list-key", "file-key"):
            assert gw.http.post("/v1/chat/completions", json=BODY, headers=bearer(key)).status_code == 200
        assert [r["headers"]["authorization"] for r in script.received] == ["Bearer list-key", "Bearer file-key"]
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL, messages=BODY["messages"])
        ok = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="file-key", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=BODY["messages"]).choices[0].message.content
        assert gw.metric("gateway_requests_total", backend="none", status="401") == 3


def test_the_clients_authorization_can_be_kept_from_the_backends() -> None:
    script = Script()
    edge = {"api_keys": ["k"], "forward_authorization": False}
    with run_fakes([script]) as (url,), run_gateway([backend_doc("b0", url)], gateway=edge) as gw:
        assert gw.http.post("/v1/chat/completions", json=BODY, headers=bearer("k")).status_code == 200
        assert "authorization" not in script.received[0]["headers"]


def test_an_unreadable_key_file_fails_at_start_up_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gateway.api_keys_file"):
        parse_settings({"gateway": {"api_keys_file": str(tmp_path / "missing")},
                        "backends": [backend_doc("b0", "http://127.0.0.1:9")]}, default_catalog(), env={})


def test_key_matching_is_exact() -> None:
    keys = [b"alpha", b"beta"]
    assert matches(b"beta", keys) and not matches(b"bet", keys) and not matches(b"betaa", keys)
    assert not matches(None, keys) and not matches(b"", keys) and not matches(b"", [])
