"""Chat templates rendered as llama-server renders them (infrastructure/chat_template.py)."""

from __future__ import annotations

import pytest

from infrastructure.chat_template import ChatTemplate, TemplateFailed

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml() -> ChatTemplate:
    return ChatTemplate(CHATML, "<s>", "</s>", strip_bos=False)


def test_messages_render_with_the_generation_prompt() -> None:
    text = chatml().render([{"role": "user", "content": "Hi"}], [])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_content_parts_are_their_text_parts_one_per_line() -> None:
    parts = [
        {"type": "text", "text": "one"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "two"},
    ]
    text = chatml().render([{"role": "user", "content": parts}], [])
    assert "user\none\ntwo<|im_end|>" in text


def test_blocks_trim_their_newlines_as_llama_cpp_does() -> None:
    source = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    text = ChatTemplate(source, "", "", strip_bos=False).render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], []
    )
    assert text == "  a\n  b\n"


def test_a_leading_bos_text_goes_when_the_tokenizer_adds_the_bos_itself() -> None:
    source = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate(source, "<s>", "", strip_bos=True).render(messages, []) == "x"
    assert ChatTemplate(source, "<s>", "", strip_bos=False).render(messages, []) == "<s>x"


def test_tools_reach_the_template_as_plain_json() -> None:
    source = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}"
    tools = [{"type": "function", "function": {"name": "f", "description": "<a & b>"}}]
    text = ChatTemplate(source, "", "", strip_bos=False).render(
        [{"role": "user", "content": "q"}], tools
    )
    assert text.startswith('[{"type": "function"') and "<a & b>" in text  # not HTML-escaped
    assert "tools" not in ChatTemplate(
        "{% if tools is defined %}tools{% endif %}", "", "", strip_bos=False
    ).render([], [])


def test_a_template_that_raises_or_does_not_parse_is_a_template_failure() -> None:
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}", "", "", False)
    with pytest.raises(TemplateFailed, match="roles must alternate"):
        raising.render([{"role": "user", "content": "x"}], [])
    with pytest.raises(TemplateFailed):
        ChatTemplate("{% for %}", "", "", strip_bos=False)
    with pytest.raises(TemplateFailed):
        ChatTemplate("{{ messages[5]['content'] }}", "", "", False).render([], [])
