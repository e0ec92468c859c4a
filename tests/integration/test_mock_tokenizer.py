"""A mock backend whose model names a tokenizer (``models.<m>.tokenizer``) tokenises as a vLLM engine
with that tokenizer: the official ``openai`` client's requests come back with ``usage.prompt_tokens``
equal to ``len(request_token_ids(...))`` computed here, and a second turn finds the first turn's
blocks in the prefix cache.

Real uvicorn servers on 127.0.0.1 (one in a thread, one a ``mock-fleet`` worker process started
and stopped by this test), the shipped tokenizer ``assets/tokenizers/kappa-mock-bpe``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry

from fleet_config import default_catalog, parse_settings
from gateway.commands.fleet import mock_fleet
from gateway.commands.processes import free_port, stop_processes
from gateway.commands.tokenizers import model_tokenizers
from mock_vllm.app_factory import build_backend_app
from tests.integration.gateway_support import poll
from tests.support.uvicorn_thread import serve_in_thread
from tokenization import EngineTokenizer, request_token_ids

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "assets" / "tokenizers" / "kappa-mock-bpe"
MODEL = "mock-8b"
BLOCK_SIZE_TOKENS = 16  # the mock engine's KV block (vLLM's default)
TIME_SCALE = 0.01
SYSTEM = ("You are the support assistant of a harbour town's ferry company. Answer questions about timetables, "
          "tickets and the weather at sea in two sentences or fewer, and say so when you do not know.")


def settings_doc(tokenizer: str, url: str = "http://127.0.0.1:8001") -> dict:
    return {"models": {MODEL: {"profile": "llama-3.1-8b", "tokenizer": tokenizer}},
            "backends": [{"id": "m", "url": url, "model": MODEL, "hardware": "h100-sxm"}]}


@pytest.fixture(scope="module")
def tok() -> EngineTokenizer:
    return EngineTokenizer.from_dir(SHIPPED)


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    """A mock built as ``kappa-gateway mock-vllm --config`` builds it, its tokenizer named relative to ROOT."""
    catalog = default_catalog()
    settings = parse_settings(settings_doc("assets/tokenizers/kappa-mock-bpe"), catalog, env={})
    [entry] = settings.backends
    tokenizers = model_tokenizers(settings, [entry], ROOT)
    app = build_backend_app(settings, entry, catalog, time_scale=TIME_SCALE, registry=CollectorRegistry(),
                            tokenizer=tokenizers[MODEL])
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def client(mock_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mock_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_prompt_tokens_are_the_engine_tokenizers_and_a_second_turn_hits_the_first_turns_blocks(
        client: openai.OpenAI, tok: EngineTokenizer) -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does the first ferry leave?"}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8)
    first_ids = request_token_ids(tok, {"messages": first}, chat=True)
    assert answer.usage.prompt_tokens == len(first_ids) > 2 * BLOCK_SIZE_TOKENS
    assert answer.usage.prompt_tokens_details.cached_tokens == 0

    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "And the last one on Sundays?"}]
    again = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8)
    second_ids = request_token_ids(tok, {"messages": second}, chat=True)
    assert second_ids[:len(first_ids)] == first_ids
    assert again.usage.prompt_tokens == len(second_ids)
    # The first turn's full blocks are cached; its generated tokens (synthetic) are not the reply's text ids.
    assert again.usage.prompt_tokens_details.cached_tokens == len(first_ids) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS


def test_a_streamed_chat_with_parts_and_tools_reports_the_same_count(client: openai.OpenAI,
                                                                      tok: EngineTokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Oban?"},
                                             {"type": "text", "text": "Tomorrow, please."}]}]
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"town": {"type": "string"}}}}}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    expected = request_token_ids(tok, {"messages": messages, "tools": tools}, chat=True)
    assert [u.prompt_tokens for u in usage] == [len(expected)]
    assert tok.decode(expected).startswith('<|bos|><|tools|>\n[{"function":{"description":null,"name":"forecast",')


def test_completions_count_bos_and_check_ids_against_the_tokenizers_vocabulary(
        client: openai.OpenAI, tok: EngineTokenizer, mock_url: str) -> None:
    text = "The tide turns at noon."
    answer = client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    assert answer.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False)) + 1  # BOS
    ids = [1, 5, tok.vocab_size - 1]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=2).usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError, match=f"Token id {tok.vocab_size} is out of vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, tok.vocab_size], max_tokens=2)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    resp = httpx.post(f"{mock_url}/v1/chat/completions", json={"model": MODEL, "messages": image}, timeout=30)
    assert resp.status_code == 400 and "'image_url' is not text" in resp.json()["error"]["message"]


def test_a_mock_fleet_worker_finds_a_tokenizer_named_relative_to_its_config(tmp_path: Path,
                                                                             tok: EngineTokenizer) -> None:
    """mock-fleet hands its workers a copy of the config in a temporary file: the tokenizer path
    must still resolve against the original file's directory."""
    url = f"http://127.0.0.1:{free_port()}"
    settings = parse_settings(settings_doc(os.path.relpath(SHIPPED, tmp_path), url), default_catalog(), env={})
    with mock_fleet(settings, time_scale=TIME_SCALE, config_dir=tmp_path), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        messages = [{"role": "user", "content": "Is the ferry running?"}]
        answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert answer.usage.prompt_tokens == len(request_token_ids(tok, {"messages": messages}, chat=True))
    with pytest.raises(ValueError, match="models.mock-8b.tokenizer: no tokenizer.json"):
        with mock_fleet(parse_settings(settings_doc("nowhere", url), default_catalog(), env={}),
                        time_scale=TIME_SCALE, config_dir=tmp_path):
            pass


def test_mock_vllm_with_a_config_loads_the_tokenizer_its_model_names(tmp_path: Path, tok: EngineTokenizer) -> None:
    """``kappa-gateway mock-vllm --config FILE --backend m``: the relative tokenizer path starts at FILE's
    directory; ``--tokenizer`` naming no tokenizer is a usage error naming the option."""
    url = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(settings_doc(os.path.relpath(SHIPPED, tmp_path), url)))
    command = [sys.executable, "-m", "gateway", "mock-vllm", "--config", str(config), "--backend", "m",
               "--time-scale", str(TIME_SCALE), "--log-level", "warning"]
    bad = subprocess.run([*command, "--tokenizer", "nowhere"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=False)
    words = " ".join(re.sub("[│╭╮╰╯─]", " ", bad.stderr).split())  # typer's error box, unwrapped
    assert bad.returncode == 2 and "--tokenizer: no tokenizer.json in 'nowhere'" in words
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                return proc.poll() is None and httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        poll(up, "the mock to answer", timeout_s=30)
        answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 1},
                            timeout=30).json()
        assert answer["usage"]["prompt_tokens"] == len(tok.prompt_token_ids("Hello world")) == 4
    finally:
        stop_processes([proc])
