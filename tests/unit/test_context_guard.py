"""The controller refuses a prompt longer than the context before any node sees it
(application/context_guard.py), on a fake counter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from application.commands import ChatPrompt, Prompt, TextPrompt
from application.context_guard import ContextGuard, ContextLengthExceeded, job_context
from interfaces.controller_main import _prepare_prompt_counts
from interfaces.services import Services

SHA = "ab" * 32
MODEL: dict[str, Any] = {"sha256": SHA, "context_size": 2048, "shape": {"context_length": 8192}}


class FakePromptCounter:
    """Answers a fixed count (None: cannot count) and records what it was asked."""

    def __init__(self, tokens: int | None) -> None:
        self.tokens = tokens
        self.asked: list[tuple[str, Prompt, int]] = []
        self.prepared: list[str] = []

    async def count(self, sha256: str, prompt: Prompt, limit: int) -> int | None:
        self.asked.append((sha256, prompt, limit))
        return self.tokens

    async def prepare(self, sha256: str) -> None:
        self.prepared.append(sha256)


def check(tokens: int | None, prompt: Prompt, model: dict[str, Any] = MODEL) -> FakePromptCounter:
    counter = FakePromptCounter(tokens)
    asyncio.run(ContextGuard(counter).check(model, prompt))
    return counter


CHAT = ChatPrompt([{"role": "user", "content": "hi"}])


def test_a_prompt_that_leaves_room_to_answer_passes_and_is_counted_against_one_slot() -> None:
    counter = check(2047, CHAT)
    assert counter.asked == [(SHA, CHAT, 2048)]


def test_a_prompt_of_the_whole_context_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ContextLengthExceeded) as refused:
        check(2048, CHAT)
    assert refused.value.param == "messages"
    assert (refused.value.context, refused.value.tokens) == (2048, 2048)
    assert "maximum context length is 2048 tokens" in str(refused.value)
    assert "resulted in 2048 tokens" in str(refused.value)


def test_a_legacy_prompt_is_refused_as_the_prompt() -> None:
    with pytest.raises(ContextLengthExceeded) as refused:
        check(5000, TextPrompt("long text"))
    assert refused.value.param == "prompt"


def test_token_ids_are_counted_by_their_number_without_the_counter() -> None:
    with pytest.raises(ContextLengthExceeded):
        check(None, TextPrompt(list(range(2048))))
    assert check(None, TextPrompt(list(range(2047)))).asked == []


def test_a_model_the_controller_cannot_count_goes_on_to_the_node() -> None:
    check(None, CHAT)  # no refusal: the node's server decides


def test_preparing_reads_each_models_file_ahead() -> None:
    counter = FakePromptCounter(None)
    other = {**MODEL, "sha256": "cd" * 32}
    asyncio.run(ContextGuard(counter).prepare([MODEL, other]))
    assert counter.prepared == [SHA, "cd" * 32]


def test_the_context_is_the_registered_one_padded_and_capped_by_training() -> None:
    assert job_context(MODEL) == 2048
    assert job_context({**MODEL, "context_size": 2000}) == 2048
    assert job_context({**MODEL, "context_size": 16384}) == 8192
    assert job_context({**MODEL, "shape": None}) == 2048
    with pytest.raises(ContextLengthExceeded) as refused:
        check(8192, CHAT, {**MODEL, "context_size": 16384})
    assert refused.value.context == 8192


def test_the_controller_reads_the_stored_models_tokenizers_as_it_starts() -> None:
    counter = FakePromptCounter(None)
    stored = {**MODEL, "stored": {"size_bytes": 1}}
    on_nodes = {**MODEL, "sha256": "cd" * 32, "stored": None}
    services = SimpleNamespace(
        read_model=SimpleNamespace(list_models=lambda: [stored, on_nodes]),
        context_guard=ContextGuard(counter),
    )
    asyncio.run(_prepare_prompt_counts(cast(Services, services)))
    assert counter.prepared == [SHA]
