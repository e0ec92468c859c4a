"""Loading a tokenizer directory: what transformers reads from it, and clear errors naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenization import EngineTokenizer

SHIPPED = Path(__file__).resolve().parents[3] / "assets" / "tokenizers" / "kappa-mock-bpe"


def tokenizer_dir(tmp_path: Path, config: object | None = None, *, name: str = "tok") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    shutil.copy(SHIPPED / "tokenizer.json", directory / "tokenizer.json")
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return directory


def test_a_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path / 'nowhere' / 'tokenizer.json'}: no such file"):
        EngineTokenizer.from_dir(tmp_path / "nowhere")


def test_a_broken_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a Hugging Face tokenizer"):
        EngineTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(("config", "match"), [
    ("{not json", r"tokenizer_config\.json: cannot read it"),
    ([1, 2], r"tokenizer_config\.json: must hold a JSON object"),
    ({"chat_template": "{% if %}"}, r"tokenizer_config\.json: chat template line 1"),
    ({"chat_template": 3}, r"tokenizer_config\.json: chat_template must be a string"),
])
def test_a_broken_config_or_template_is_named(tmp_path: Path, config: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineTokenizer.from_dir(tokenizer_dir(tmp_path, config))


def test_without_a_template_completions_work_and_chats_are_refused(tmp_path: Path) -> None:
    tok = EngineTokenizer.from_dir(tokenizer_dir(tmp_path, name="plain"))
    assert (tok.name, tok.template, tok.special_tokens) == ("plain", None, {})
    assert tok.prompt_token_ids("Hello world") == [1, 9381, 4751, 734]  # BOS comes from tokenizer.json
    with pytest.raises(ValueError, match="'plain' has no chat template"):
        tok.chat_token_ids([{"role": "user", "content": "x"}])


def test_special_tokens_as_added_token_objects_and_a_named_template_list(tmp_path: Path) -> None:
    config = {"bos_token": {"__type": "AddedToken", "content": "<|bos|>"}, "eos_token": "<|eos|>",
              "chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    tok = EngineTokenizer.from_dir(tokenizer_dir(tmp_path, config))
    assert tok.special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    assert tok.chat_token_ids([{"role": "user", "content": "Hello world"}]) == [1, 9381, 4751, 734]


def test_a_chat_template_jinja_file_serves_when_the_config_has_none(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, {"bos_token": "<|bos|>"})
    (directory / "chat_template.jinja").write_text("{{ bos_token }}<|user|>\n{{ messages[0]['content'] }}")
    tok = EngineTokenizer.from_dir(directory)
    assert tok.decode(tok.chat_token_ids([{"role": "user", "content": "hi"}])) == "<|bos|><|user|>\nhi"
    assert tok.chat_token_ids([{"role": "user", "content": "hi"}])[:2] == [1, 5]
