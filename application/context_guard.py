"""Refuses a prompt longer than the context a job would get, before any node sees it.

The controller counts the prompt with the model file's own tokenizer and chat template
(:class:`application.ports.PromptCounter`) against one slot's context
(:func:`domain.context_window.slot_context`). Where it cannot count (it does not hold the
file, or the file's tokenizer is not one it reproduces) the request goes on, and the node's
server refuses a prompt too long for it with the same 400 (recorded as ``JOB_REJECTED``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from application.commands import Prompt, TextPrompt
from application.errors import ApplicationError
from application.ports import PromptCounter
from domain.context_window import fits, slot_context


class ContextLengthExceeded(ApplicationError):
    """The prompt does not fit: the HTTP interface answers OpenAI's 400
    ``context_length_exceeded`` (``common.contract.CONTEXT_LENGTH_EXCEEDED``)."""

    def __init__(self, context: int, tokens: int, prompt: Prompt) -> None:
        self.context = context
        self.tokens = tokens
        self.param = "prompt" if isinstance(prompt, TextPrompt) else "messages"
        super().__init__(
            f"This model's maximum context length is {context} tokens. However, your "
            f"{self.param} resulted in {tokens} tokens (one slot of a server holds {context}, "
            f"and the answer needs at least one more). Please reduce the length of the "
            f"{self.param}."
        )


def job_context(model: Mapping[str, Any]) -> int:
    """The context one job of ``model`` gets: its registered context size per slot, padded
    and capped by the file's training context as llama.cpp does."""
    shape = model.get("shape") or {}
    return slot_context(int(model["context_size"]), int(shape.get("context_length") or 0))


class ContextGuard:
    def __init__(self, counter: PromptCounter) -> None:
        self.counter = counter

    async def prepare(self, models: list[dict[str, Any]]) -> None:
        """Gets the counts for ``models`` ready, so that no first request waits for them."""
        for model in models:
            await self.counter.prepare(str(model["sha256"]))

    async def check(self, model: Mapping[str, Any], prompt: Prompt) -> None:
        """Raises :class:`ContextLengthExceeded` when ``prompt`` is known not to fit."""
        context = job_context(model)
        if isinstance(prompt, TextPrompt) and isinstance(prompt.text, list):
            tokens: int | None = len(prompt.text)  # token ids: the count is their number
        else:
            tokens = await self.counter.count(str(model["sha256"]), prompt, context)
        if tokens is not None and not fits(tokens, context):
            raise ContextLengthExceeded(context, tokens, prompt)
