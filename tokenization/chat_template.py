"""A chat template rendered as Hugging Face transformers' ``apply_chat_template`` renders it.

Source: transformers ``utils/chat_template_utils.py`` (``_compile_jinja_template``,
``render_jinja_template``) and ``tokenization_utils_base.py`` (``apply_chat_template``), which
vLLM calls (``vllm/entrypoints/chat_utils.py::apply_hf_chat_template``) with ``tokenize=False``:

* the environment is jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)`` with the ``loopcontrols`` extension and transformers' ``{% generation %}``
  tag (here it renders its body, as transformers does when no assistant mask is asked for);
* ``tojson`` is replaced by ``json.dumps`` with ``ensure_ascii=False`` (jinja2's own escapes HTML
  and sorts keys); ``raise_exception(message)`` raises ``TemplateError``; ``strftime_now(fmt)``
  formats the local time now;
* the variables are ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
  tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and any further keyword
  arguments (vLLM's ``chat_template_kwargs``), which win over the special tokens;
* ``continue_final_message`` cuts the rendered text just after the final message's content, so
  the model continues it (transformers' rule, including its care for trailing whitespace the
  template trimmed).

Errors come out as `ValueError` (vLLM answers a failed render 400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate"]


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: marks assistant text; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _final_text(message: Mapping[str, Any]) -> str:
    """The final message's text, as transformers finds it for ``continue_final_message``."""
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        texts = [part["text"] for part in content if isinstance(part, Mapping) and "text" in part]
        if not texts:
            raise ValueError("continue_final_message is set but the final message has no text content")
        content = texts[-1]
    if not isinstance(content, str):
        raise ValueError("continue_final_message is set but the final message has no text content")
    return content


def _cut_after_final_message(rendered: str, final: str) -> str:
    if final.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template")
    at = rendered.rindex(final.strip())
    if rendered[at:at + len(final.lstrip())] == final:  # the template kept the message's trailing whitespace
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(final.strip())]


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with.

    Args:
        source: the Jinja source (``tokenizer_config.json``'s ``chat_template``).
        special_tokens: ``bos_token``, ``eos_token``, ... as strings (transformers'
            ``special_tokens_map``), passed to every render.

    Raises:
        ValueError: the source is not a valid Jinja template (the message names the line).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template line {exc.lineno}: {exc.message}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               documents: Sequence[Mapping[str, Any]] | None = None, variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a conversation (module docstring for the variables).

        Args:
            messages: conversation messages as the template reads them (``role``, ``content``,
                ``tool_calls``, ...), already in the engine's form (`tokenization.requests`).
            tools: tool definitions, or None.
            add_generation_prompt: open an assistant turn at the end.
            continue_final_message: leave the final message open instead (not with
                ``add_generation_prompt``).
            documents: RAG documents for templates that read them.
            variables: further template variables (``chat_template_kwargs``); they win over the
                special tokens, not over the arguments above.

        Returns:
            The rendered text, special tokens written out as text.

        Raises:
            ValueError: both ``add_generation_prompt`` and ``continue_final_message``, an empty
                conversation with ``continue_final_message``, or a render that failed (the
                template's ``raise_exception``, an undefined operation, a value it cannot print).
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: use "
                             "continue_final_message to continue the final message, add_generation_prompt to "
                             "start a new assistant turn")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message is set but there are no messages")
        context = {**self.special_tokens, **(variables or {}), "messages": messages, "tools": tools,
                   "documents": documents, "add_generation_prompt": add_generation_prompt}
        try:
            rendered = self._template.render(context)
        except (jinja2.TemplateError, TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"the chat template could not be rendered: {exc.__class__.__name__}: {exc}") from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, _final_text(messages[-1]))
        return rendered
