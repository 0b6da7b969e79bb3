"""A model's chat template rendered as llama-server renders it, so that the controller sees
the very prompt the server will tokenize.

The template is the GGUF file's ``tokenizer.chat_template`` (Jinja). llama-server renders it
with ``trim_blocks`` and ``lstrip_blocks``, the ``messages`` (a content given as parts becomes
its text parts joined by newlines), the ``tools`` when there are any, ``bos_token`` and
``eos_token``, ``add_generation_prompt`` and ``enable_thinking`` true, and drops a leading BOS
text when the tokenizer adds the BOS itself (``common_chat_template_direct_apply``). Here
Jinja2's sandbox does the rendering, with the helpers templates call (``raise_exception``,
``strftime_now``, a ``tojson`` that writes JSON as Python's ``json.dumps`` does).

Imports only the standard library and ``jinja2``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateFailed(ValueError):
    """The template cannot be rendered here (bad syntax, or it raised for these messages)."""


def _raise(message: str) -> None:
    raise TemplateFailed(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _text_of(content: Any) -> Any:
    """A content given as parts is the text of its text parts, one per line."""
    if not isinstance(content, list):
        return content
    return "\n".join(
        str(part.get("text", ""))
        for part in content
        if isinstance(part, dict) and part.get("type") == "text"
    )


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str, strip_bos: bool) -> None:
        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise TemplateFailed(f"the chat template does not parse: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The prompt text for ``messages`` (and ``tools``), ready for the tokenizer."""
        shown = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        context: dict[str, Any] = {
            "messages": shown,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": True,
            "enable_thinking": True,
        }
        if tools:
            context["tools"] = tools
        try:
            text = self._template.render(**context)
        except TemplateFailed:
            raise
        except Exception as e:  # a template may fail any way Jinja can
            raise TemplateFailed(f"the chat template failed: {e!r}") from e
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text
