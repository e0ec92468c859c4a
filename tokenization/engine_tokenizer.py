"""A model's tokenizer as its vLLM engines load it: ``tokenizer.json`` plus ``tokenizer_config.json``.

vLLM loads a model's tokenizer with transformers' ``AutoTokenizer.from_pretrained`` (a "fast"
tokenizer: the Hugging Face ``tokenizers`` library behind ``tokenizer.json``), and reads the chat
template and the special tokens from ``tokenizer_config.json``. This module loads the same two
files with ``tokenizers`` and jinja2 alone:

* ``tokenizer.json``: ``tokenizers.Tokenizer.from_file``; its normalizer, pre-tokenizer, model,
  post-processor (which adds BOS when ``add_special_tokens``) and added tokens are the engine's.
* ``tokenizer_config.json`` (optional): ``chat_template`` (a string, or transformers' list of
  ``{name, template}`` whose ``default`` is used), ``bos_token``, ``eos_token``, ``unk_token``,
  ``pad_token``, ... (strings or ``{"content": ...}`` objects) and
  ``additional_special_tokens``. Without a ``chat_template`` there, a ``chat_template.jinja``
  beside it is used (transformers' newer layout); without either, chat requests are refused,
  as vLLM refuses them.

Encoding follows vLLM's serving code (``vllm/entrypoints/openai/serving_chat.py``,
``serving_completion.py``, ``protocol.py``): a rendered chat is encoded with
``add_special_tokens=False`` (the template writes BOS itself), a completion prompt string with
``add_special_tokens=True``, and token ids pass through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenization.chat_template import ChatTemplate

__all__ = ["EngineTokenizer", "SPECIAL_TOKEN_KEYS"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names the chat template sees them under.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Template variables a request's chat_template_kwargs may not set (vLLM refuses the first two).
_RESERVED_KWARGS = ("chat_template", "tokenize", "messages", "conversation")
# chat_template_kwargs that are apply_chat_template's own arguments (vLLM merges them over its own).
_RENDER_ARGUMENTS = ("add_generation_prompt", "continue_final_message", "tools", "documents")


def _token_text(value: Any) -> str | None:
    """A special token as transformers stores it: a string or an AddedToken object's ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from exc


def _template_source(config: Mapping[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers: [{"name": ..., "template": ...}], "default" is used
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is None and (directory / TEMPLATE_FILE).is_file():
        template = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / CONFIG_FILE}: chat_template must be a string or a list of "
                         f"{{name, template}}, got {type(template).__name__}")
    return template


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    tokens: dict[str, Any] = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return tokens


class EngineTokenizer:
    """One model's tokenizer and chat template, encoding as its vLLM engines do (module docstring).

    Build it with `from_dir`. Thread-safe for encoding (``tokenizers`` encodes without shared
    mutable state; the template is immutable).

    Attributes:
        name: the tokenizer's name (its directory's name).
        vocab_size: ids in [0, vocab_size) are valid, added tokens included (vLLM's
            ``max_token_id`` + 1, what it checks prompt ids against).
        special_tokens: ``bos_token``, ``eos_token``, ... as strings, as the template sees them.
        template: the chat template, or None when the tokenizer has none.
    """

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, special_tokens: Mapping[str, Any],
                 name: str) -> None:
        self._tokenizer = tokenizer
        self.template = template
        self.special_tokens = dict(special_tokens)
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> EngineTokenizer:
        """Load ``path/tokenizer.json`` and, if present, ``path/tokenizer_config.json``.

        Raises:
            ValueError: a missing or unreadable ``tokenizer.json``, a ``tokenizer_config.json``
                that is not a JSON object, or a chat template that does not compile; the message
                names the file.
        """
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(f"{tokenizer_file}: no such file (a model's tokenizer directory holds a Hugging Face "
                             f"{TOKENIZER_FILE})")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{tokenizer_file}: not a Hugging Face tokenizer: {exc}") from exc
        config_file = directory / CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: must hold a JSON object")
        special = _special_tokens(config)
        source = _template_source(config, directory)
        try:
            template = None if source is None else ChatTemplate(source, special)
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from exc
        return cls(tokenizer, template, special, directory.resolve().name)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (special tokens written in it become their ids).

        ``add_special_tokens`` runs the post-processor (BOS for most models), as transformers'
        ``encode`` does.
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat's prompt text (`tokenization.chat_template.ChatTemplate.render`).

        ``chat_template_kwargs`` may also set ``add_generation_prompt``, ``continue_final_message``,
        ``tools`` and ``documents`` (vLLM merges them over its own).

        Raises:
            ValueError: no chat template, a reserved kwarg (``chat_template``, ``tokenize``,
                ``messages``), or a failed render.
        """
        if self.template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template ({CONFIG_FILE} chat_template), so "
                             "chat requests cannot be rendered")
        kwargs = {"add_generation_prompt": add_generation_prompt, "tools": tools, **(chat_template_kwargs or {})}
        reserved = sorted(set(kwargs) & set(_RESERVED_KWARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        arguments = {k: kwargs.pop(k) for k in _RENDER_ARGUMENTS if k in kwargs}
        return self.template.render(messages, **arguments, variables=kwargs)

    def chat_token_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                       add_generation_prompt: bool = True,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt ids of a chat: the rendered template encoded with ``add_special_tokens=False``.

        Args:
            messages: messages in the engine's form (``content`` a string; see
                `tokenization.requests.request_token_ids` for an OpenAI request body).
            tools: tool definitions as the template reads them.
            add_generation_prompt: open an assistant turn at the end (vLLM's default).
            chat_template_kwargs: further template variables (`render_chat`).

        Returns:
            Token ids, each in [0, vocab_size).

        Raises:
            ValueError: see `render_chat`.
        """
        text = self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt,
                                chat_template_kwargs=chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def prompt_token_ids(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: a string encoded with special tokens (BOS), ids unchanged.

        Raises:
            ValueError: an id outside [0, vocab_size) (vLLM: "Token id ... is out of vocabulary").
        """
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=add_special_tokens)
        bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary (size {self.vocab_size})")
        return list(prompt)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (byte-level BPE: the exact text they were encoded from)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"EngineTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"
