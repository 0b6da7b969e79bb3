"""OpenAI's answers from a job's stream items: chat completions and legacy completions,
streamed as server-sent events or collected into one JSON object, and embeddings.

A delta's text is the content; what llama-server sent besides it (``Delta.extra``: tool-call
fragments and reasoning in ``delta``, and the choice's ``logprobs``) is passed on as it came
when streaming, and merged when collecting (tool-call fragments joined by index, logprobs
concatenated). A forced tool call (:mod:`interfaces.http.openai.openai_tools`) is collected even
when streamed, then sent as ``delta.tool_calls`` fragments.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from application.commands import Delta, JobOutcome
from application.job_run import JobRun, StreamItem
from interfaces.http.http_errors import ApiError, error_body
from interfaces.http.openai import openai_tools

ErrorOf = Callable[[str, str], ApiError]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"
CHAT_CHUNK = "chat.completion.chunk"


def _usage_of(outcome: JobOutcome) -> dict[str, Any]:
    """A generation's usage as OpenAI gives it, with the prompt tokens llama-server took from
    its cache in ``prompt_tokens_details.cached_tokens`` (0 when none)."""
    prompt, completion = outcome.prompt_tokens, outcome.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_prompt_tokens},
    }


@dataclass(frozen=True)
class Answer:
    """Who the answer is for: its id, creation time, model, and the request's options."""

    id: str
    created: int
    model: str
    include_usage: bool = False
    #: The functions a forced tool call chooses from (None: not forced).
    forced_tools: list[str] | None = None
    #: How many alternatives each token's logprobs keep (None: no logprobs asked for).
    top_logprobs: int | None = None

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """An OpenAI object of ``kind`` for this answer, around ``choices``."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def streamed(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed chunk: with ``usage`` null when the usage comes in a chunk of its own."""
        payload = self.envelope(kind, choices)
        if self.include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(self, kind: str, outcome: JobOutcome) -> bytes:
        """The last chunk, with ``stream_options.include_usage``: no choices, the usage."""
        return sse({**self.envelope(kind, []), "usage": _usage_of(outcome)})


def trimmed(entries: list[dict[str, Any]], top: int | None) -> list[dict[str, Any]]:
    """Token logprobs with at most ``top`` alternatives each (llama-server is asked for at
    least one)."""
    if top is None or all(len(e.get("top_logprobs") or ()) <= top for e in entries):
        return entries
    return [{**e, "top_logprobs": (e.get("top_logprobs") or [])[:top]} for e in entries]


@dataclass
class Collected:
    """A whole answer gathered from deltas."""

    top: int | None = None
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[Any] = field(default_factory=list)

    def add(self, deltas: Iterable[Delta]) -> None:
        for d in deltas:
            self.texts.append(d.text)
            if d.extra:
                self._extra(orjson.loads(d.extra))

    def _extra(self, extra: dict[str, Any]) -> None:
        delta = extra.get("delta") or {}
        if isinstance(reasoning := delta.get("reasoning_content"), str):
            self.reasoning.append(reasoning)
        for fragment in delta.get("tool_calls") or ():
            call = self.calls.setdefault(
                int(fragment.get("index", 0)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = fragment.get("id") or call["id"]
            function = fragment.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
        logprobs = extra.get("logprobs")
        if isinstance(logprobs, dict):
            self.logprobs.extend(trimmed(logprobs.get("content") or [], self.top))

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _tool_calls(answer: Answer, collected: Collected, finish: str) -> tuple[Any, str]:
    """The ``tool_calls`` of the answer and its finish reason."""
    if answer.forced_tools is not None:
        calls = openai_tools.tool_calls_of(collected.text, answer.forced_tools)
        if calls is not None:
            return calls, "tool_calls"
        return None, finish
    if collected.calls:
        return [collected.calls[i] for i in sorted(collected.calls)], finish
    return None, finish


def chat_message(answer: Answer, collected: Collected, outcome: JobOutcome) -> dict[str, Any]:
    calls, finish = _tool_calls(answer, collected, outcome.finish_reason)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and answer.forced_tools is not None else collected.text,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    if collected.reasoning:
        message["reasoning_content"] = "".join(collected.reasoning)
    logprobs = {"content": collected.logprobs, "refusal": None} if collected.logprobs else None
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {**answer.envelope("chat.completion", [choice]), "usage": _usage_of(outcome)}


def legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's per-token logprobs (already trimmed) in a legacy completion's shape."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for entry in entries:
        token = str(entry.get("token", ""))
        tokens.append(token)
        token_logprobs.append(entry.get("logprob"))
        top.append({t.get("token", ""): t.get("logprob") for t in entry.get("top_logprobs") or ()})
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def completion(answer: Answer, collected: Collected, outcome: JobOutcome) -> dict[str, Any]:
    logprobs = legacy_logprobs(collected.logprobs) if collected.logprobs else None
    choice = {
        "index": 0,
        "text": collected.text,
        "logprobs": logprobs,
        "finish_reason": outcome.finish_reason,
    }
    return {**answer.envelope("text_completion", [choice]), "usage": _usage_of(outcome)}


async def collect(
    run: JobRun, first: StreamItem, error_of: ErrorOf, top: int | None = None
) -> tuple[Collected, JobOutcome]:
    """The job's whole answer; raises the job's failure as an :class:`ApiError`."""
    collected = Collected(top)
    item = first
    while item.kind == "deltas":
        collected.add(item.deltas)
        item = await run.queue.get()
    if item.kind == "error":
        raise error_of(item.error, item.error_code)
    assert item.outcome is not None
    return collected, item.outcome


def embeddings(model: str, outcome: JobOutcome, encoding: str) -> dict[str, Any]:
    data = orjson.loads(outcome.output or b"[]")
    items = []
    for index, entry in enumerate(sorted(data, key=lambda e: int(e.get("index", 0)))):
        vector = entry.get("embedding") or []
        if encoding == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        items.append({"object": "embedding", "index": index, "embedding": vector})
    prompt = outcome.prompt_tokens
    return {
        "object": "list",
        "data": items,
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


class ChatStream:
    """The SSE events of a streamed chat completion (``chat.completion.chunk`` objects)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        # Content chunks are the hot path: the same JSON as chunk({"content": text}), built
        # from two constant halves around the encoded text.
        head, tail = sse(self.chunk({"content": ""})).split(b'"content":""', 1)
        self._head, self._tail = head + b'"content":', tail

    def chunk(
        self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.answer.streamed(CHAT_CHUNK, [choice])

    def first(self) -> bytes:
        return sse(self.chunk({"role": "assistant", "content": ""}))

    def deltas(self, deltas: list[Delta]) -> Iterable[bytes]:
        if not any(d.extra for d in deltas):
            text = "".join(d.text for d in deltas)
            if text:
                yield self._head + orjson.dumps(text) + self._tail
            return
        for d in deltas:
            extra = orjson.loads(d.extra) if d.extra else {}
            delta = {**(extra.get("delta") or {})}
            if d.text:
                delta["content"] = d.text
            logprobs = extra.get("logprobs")
            if isinstance(logprobs, dict):
                content = trimmed(logprobs.get("content") or [], self.answer.top_logprobs)
                logprobs = {**logprobs, "content": content, "refusal": None}
            yield sse(self.chunk(delta, logprobs=logprobs))

    def ending(self, collected: Collected | None, outcome: JobOutcome) -> Iterable[bytes]:
        finish = outcome.finish_reason
        if collected is not None:  # a forced tool call, collected
            calls, finish = _tool_calls(self.answer, collected, finish)
            if calls is None:
                yield sse(self.chunk({"content": collected.text}))
            else:
                yield sse(self.chunk({"tool_calls": openai_tools.streamed(calls)}))
        yield sse(self.chunk({}, finish))
        if self.answer.include_usage:
            yield self.answer.usage_chunk(CHAT_CHUNK, outcome)


class CompletionStream:
    """The SSE events of a streamed legacy completion (``text_completion`` objects)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def chunk(self, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(self.answer.streamed("text_completion", [choice]))

    def first(self) -> bytes:
        return b""

    def deltas(self, deltas: list[Delta]) -> Iterable[bytes]:
        if not any(d.extra for d in deltas):
            text = "".join(d.text for d in deltas)
            if text:
                yield self.chunk(text)
            return
        for d in deltas:
            collected = Collected(self.answer.top_logprobs)
            collected.add([d])
            logprobs = legacy_logprobs(collected.logprobs) if collected.logprobs else None
            yield self.chunk(d.text, logprobs=logprobs)

    def ending(self, collected: Collected | None, outcome: JobOutcome) -> Iterable[bytes]:
        yield self.chunk("", outcome.finish_reason)
        if self.answer.include_usage:
            yield self.answer.usage_chunk("text_completion", outcome)


async def stream_events(
    run: JobRun,
    first: StreamItem,
    events: ChatStream | CompletionStream,
    on_abandon: Callable[[], None],
    on_outcome: Callable[[JobOutcome], None] | None = None,
) -> AsyncIterator[bytes]:
    """The answer's events from the job's stream items; ``on_abandon`` runs when the client
    leaves before the end, ``on_outcome`` with the job's outcome when it completed."""
    forced = isinstance(events, ChatStream) and events.answer.forced_tools is not None
    collected = Collected(events.answer.top_logprobs) if forced else None
    finished = False
    # The events of one step go out in one write: the opening with the first tokens, the
    # tokens already waiting together, the ending with [DONE].
    pending: list[bytes] = []
    try:
        if opening := events.first():
            pending.append(opening)
        item = first
        while True:
            if item.kind == "deltas":
                deltas = list(item.deltas)
                waiting = _drain(run.queue, deltas)
                if collected is not None:
                    collected.add(deltas)
                else:
                    pending.extend(events.deltas(deltas))
                if pending:
                    yield b"".join(pending)
                    pending.clear()
                item = waiting if waiting is not None else await run.queue.get()
                continue
            finished = True
            if item.kind == "error":
                pending.append(sse(error_body(item.error, "server_error", item.error_code)))
                yield b"".join(pending)
                return
            assert item.outcome is not None
            if on_outcome is not None:
                on_outcome(item.outcome)
            pending.extend(events.ending(collected, item.outcome))
            pending.append(DONE)
            yield b"".join(pending)
            return
    finally:
        if not finished:
            on_abandon()


def _drain(queue: asyncio.Queue[StreamItem], deltas: list[Delta]) -> StreamItem | None:
    """Adds the deltas of the items already queued; returns the first other item."""
    while not queue.empty():
        item = queue.get_nowait()
        if item.kind != "deltas":
            return item
        deltas.extend(item.deltas)
    return None
