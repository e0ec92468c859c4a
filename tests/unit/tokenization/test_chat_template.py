"""Chat templates render as transformers' apply_chat_template renders them (chat_template_utils.py):
sandboxed jinja2 with trim_blocks and lstrip_blocks, its tojson and raise_exception, special tokens
and kwargs as variables, and continue_final_message's cut."""

from __future__ import annotations

import pytest

from tokenization import ChatTemplate

HI = [{"role": "user", "content": "Hi"}]


def render(source: str, messages=HI, variables=None, **arguments) -> str:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages, **arguments,
                                                                                   variables=variables)


def test_block_tags_leave_no_whitespace_of_their_own() -> None:
    """trim_blocks drops the newline after a block tag, lstrip_blocks the indent before one."""
    source = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    assert render(source, [{"role": "user", "content": "a"}, {"role": "x", "content": "b"},
                           {"role": "user", "content": "c"}]) == "a\nc\n"


def test_tojson_is_json_dumps_without_html_escapes_or_sorting() -> None:
    value = {"b": "<é>", "a": [1, 2]}
    assert render("{{ v | tojson }}", variables={"v": value}) == '{"b": "<é>", "a": [1, 2]}'
    assert render("{{ v | tojson(separators=(',', ':'), sort_keys=True) }}", variables={"v": value}) == '{"a":[1,2],"b":"<é>"}'
    assert render("{{ v | tojson(indent=1) }}", variables={"v": [1]}) == "[\n 1\n]"


def test_special_tokens_and_kwargs_are_variables_and_kwargs_win() -> None:
    source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{{ flavour }}"
    assert render(source, variables={"flavour": "!"}) == "<s>Hi</s>!"
    assert render(source, variables={"flavour": "", "eos_token": "<end>", "self": "?"}) == "<s>Hi<end>"
    assert render(source, variables={"messages": [{"content": "no"}]}) == "<s>Hi</s>"  # the arguments win


def test_generation_prompt_tools_and_documents_reach_the_template() -> None:
    source = "{% if add_generation_prompt %}G{% endif %}{% if tools %}T{{ tools | length }}{% endif %}" \
             "{% if documents %}D{% endif %}"
    assert render(source) == "G"
    assert render(source, add_generation_prompt=False, tools=[{}, {}], documents=[{"text": "d"}]) == "T2D"


def test_raise_exception_fails_the_render_with_its_message() -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system message first') }}{% endif %}"
    with pytest.raises(ValueError, match="TemplateError: system message first"):
        render(source)


def test_generation_tag_and_loop_controls_parse() -> None:
    assert render("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}") == "Hi"
    source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    assert render(source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_the_sandbox_refuses_to_mutate_its_inputs() -> None:
    with pytest.raises(ValueError, match="SecurityError"):
        render("{{ messages.append(1) }}")


def test_a_syntax_error_names_the_line() -> None:
    with pytest.raises(ValueError, match="chat template line 2: "):
        ChatTemplate("ok\n{% for m in messages %}")


CHATML = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>\n{% endfor %}" \
         "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.mark.parametrize(("final", "expected"), [
    ("Sure", "<user>Hi</>\n<assistant>Sure"),
    ("Sure  ", "<user>Hi</>\n<assistant>Sure  "),  # the template kept the trailing spaces: they stay
    ("  Sure", "<user>Hi</>\n<assistant>  Sure"),
])
def test_continue_final_message_cuts_after_the_final_content(final: str, expected: str) -> None:
    messages = [*HI, {"role": "assistant", "content": final}]
    assert render(CHATML, messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_continue_final_message_after_a_template_that_trimmed_trailing_space() -> None:
    source = "{% for m in messages %}{{ m['content'] | trim }}<end>{% endfor %}"
    messages = [*HI, {"role": "assistant", "content": "Sure  "}]
    assert render(source, messages, add_generation_prompt=False, continue_final_message=True) == "Hi<end>Sure"


def test_continue_final_message_reads_the_last_text_part_and_refuses_what_is_not_there() -> None:
    parts = [{"type": "text", "text": "x"}, {"type": "text", "text": "Sure"}]
    source = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}|{% endfor %}"
    assert render(source, [{"role": "assistant", "content": parts}], add_generation_prompt=False,
                  continue_final_message=True) == "xSure"
    with pytest.raises(ValueError, match="does not appear"):
        render("{{ 'nothing' }}", add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="not compatible"):
        render(CHATML, continue_final_message=True)
