"""What the agent's job handler says and parses: SetupResult/JobResult error codes and
messages, token deltas, generation statistics, and the request the controller's plan carries."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.control.control_handler import Send
from agent.runtime.llama_server import ChatRequest, EmbeddingsRequest
from agent.runtime.runtime_errors import (
    ContextTooLong,
    LlamaRuntimeError,
    RequestRejected,
    RuntimeCrashedError,
)
from common.contract import CONTEXT_LENGTH_EXCEEDED, REQUEST_REJECTED, JobErrorCode
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

# SetupResult / JobResult error codes: short names for common.contract.JobErrorCode's members.
MODEL_NOT_FOUND = JobErrorCode.MODEL_NOT_FOUND
SHA256_MISMATCH = JobErrorCode.SHA256_MISMATCH
RPC_PEER_UNREACHABLE = JobErrorCode.RPC_PEER_UNREACHABLE
RUNTIME_START_FAILED = JobErrorCode.RUNTIME_START_FAILED
RUNTIME_BUSY = JobErrorCode.RUNTIME_BUSY
INVALID_PLAN = JobErrorCode.INVALID_PLAN
JOB_ALREADY_RUNNING = JobErrorCode.JOB_ALREADY_RUNNING
AGENT_STOPPING = JobErrorCode.AGENT_STOPPING
RUNTIME_CRASHED = JobErrorCode.RUNTIME_CRASHED
GENERATION_FAILED = JobErrorCode.GENERATION_FAILED
CANCELLED = JobErrorCode.CANCELLED
JOB_LOST = JobErrorCode.JOB_LOST


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


class SetupFailure(Exception):
    """Setup and validation failed; becomes ``SetupResult{ok=false}``."""

    def __init__(
        self,
        error_code: str,
        message: str,
        *,
        failed_node_id: str = "",
        failed_device: str = "",
        failed_bytes: int = 0,
    ) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message
        self.failed_node_id = failed_node_id
        #: An out-of-memory: the device (as its node's llama.cpp names it) and bytes asked.
        self.failed_device = failed_device
        self.failed_bytes = failed_bytes


#: The shortest time between two TokenChunks of one job, after its first (the agent's
#: ``--stream-interval``): the pieces that come meanwhile go together. On a machine whose cores
#: llama.cpp's threads keep busy, every message wakes the agent, the controller and the client
#: once, and a gRPC write was a third of the agent's CPU. Decode through the controller against
#: direct llama-server, paired over 30 prompts (docs/performance.md): 0.91x sending each piece
#: at once, 0.94x every 25 ms, 0.97x every 50 ms (five tokens at 100 tokens/s, twenty updates a
#: second), 0.97-0.98x every 100 ms. The first piece never waits.
TOKEN_BATCH_SECONDS = 0.05


class DeltaSender:
    """Sends one job's text pieces in order: the first at once, the next ones together at most
    every :data:`TOKEN_BATCH_SECONDS` (each still a ``Delta`` of its own, numbered).

    :meth:`push` numbers a piece (``seq`` from 0, no gaps). :meth:`flush` sends what waits; call
    it before the job's result or failure. :meth:`discard` drops what waits (a cancelled job).
    The session's ``send`` only queues the message; its write loop merges chunks that queue up
    behind a pending gRPC write.
    """

    def __init__(
        self,
        job_id: str,
        send: Send,
        interval: float = TOKEN_BATCH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.job_id = job_id
        self._send = send
        self._interval = interval
        self._clock = clock
        self._sleep = sleep
        self.next_seq = 0
        self._waiting: list[pb.Delta] = []
        self._last_sent: float | None = None
        self._flusher: asyncio.Task[None] | None = None

    async def push(self, text: str, tokens: int = 1, extra: str = "") -> None:
        delta = pb.Delta(seq=self.next_seq, text=text, tokens=tokens, extra_json=extra)
        self.next_seq += 1
        now = self._clock()
        since = None if self._last_sent is None else now - self._last_sent
        if not self._waiting and (since is None or since >= self._interval):
            await self._send_now([delta], now)
            return
        self._waiting.append(delta)
        if self._flusher is None:
            delay = self._interval - (since or 0.0)
            self._flusher = asyncio.get_running_loop().create_task(self._flush_after(delay))

    async def flush(self) -> None:
        """Sends the pieces that wait, now."""
        self._stop_flusher()
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            await self._send_now(waiting, self._clock())

    def discard(self) -> None:
        """Drops the pieces that wait (the job was cancelled)."""
        self._stop_flusher()
        self._waiting = []

    async def _flush_after(self, delay: float) -> None:
        await self._sleep(max(0.0, delay))
        self._flusher = None
        await self.flush()

    def _stop_flusher(self) -> None:
        flusher, self._flusher = self._flusher, None
        if flusher is not None and flusher is not asyncio.current_task():
            flusher.cancel()

    async def _send_now(self, deltas: list[pb.Delta], now: float) -> None:
        self._last_sent = now
        chunk = pb.TokenChunk(job_id=self.job_id, deltas=deltas)
        await self._send(pb.AgentMessage(token_chunk=chunk))


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    tokens_per_second: float
    #: Of ``prompt_tokens``, those llama-server reused from its cache (0: none or not said).
    cached_prompt_tokens: int = 0


def generation_stats(
    *,
    started: float,
    first_piece: float | None,
    last_piece: float | None,
    pieces: int,
    usage_prompt_tokens: int | None = None,
    usage_completion_tokens: int | None = None,
    timings_prompt_tokens: int | None = None,
    timings_prompt_ms: float | None = None,
    timings_predicted_tokens: int | None = None,
    timings_predicted_ms: float | None = None,
    usage_cached_tokens: int | None = None,
    timings_cached_tokens: int | None = None,
) -> GenerationStats:
    """Usage and speed of one generation: llama-server's numbers when it sent them, else
    what the agent measured (``time.monotonic()`` seconds; ``pieces`` streamed text pieces)."""
    completion = usage_completion_tokens
    if completion is None:
        completion = timings_predicted_tokens if timings_predicted_tokens is not None else pieces
    prompt = usage_prompt_tokens
    if prompt is None:
        prompt = timings_prompt_tokens or 0
    cached = usage_cached_tokens if usage_cached_tokens is not None else timings_cached_tokens
    if timings_prompt_ms is not None and timings_prompt_ms > 0:
        ttft_ms = timings_prompt_ms
    elif first_piece is not None:
        ttft_ms = (first_piece - started) * 1000.0
    else:
        ttft_ms = 0.0
    if timings_predicted_ms and timings_predicted_tokens:
        tps = timings_predicted_tokens * 1000.0 / timings_predicted_ms
    elif first_piece is not None and last_piece is not None and pieces > 1:
        elapsed = last_piece - first_piece
        tps = (pieces - 1) / elapsed if elapsed > 0 else 0.0
    else:
        tps = 0.0
    return GenerationStats(
        prompt_tokens=max(0, prompt),
        completion_tokens=max(0, completion),
        time_to_first_token_ms=max(0.0, ttft_ms),
        tokens_per_second=max(0.0, tps),
        cached_prompt_tokens=max(0, cached or 0),
    )


def _json_list(text: str, name: str) -> list[dict[str, Any]]:
    """A JSON list of objects; raises :class:`SetupFailure` (``INVALID_PLAN``)."""
    try:
        items = json.loads(text) if text else None
    except ValueError as exc:
        raise SetupFailure(INVALID_PLAN, f"{name} is not JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise SetupFailure(INVALID_PLAN, f"{name} must be a non-empty list")
    if not all(isinstance(item, dict) for item in items):
        raise SetupFailure(INVALID_PLAN, f"every item of {name} must be a JSON object")
    return items


def parse_messages(messages_json: str) -> list[dict[str, Any]]:
    """The plan's chat messages; raises :class:`SetupFailure` (``INVALID_PLAN``)."""
    return _json_list(messages_json, "chat.messages_json")


def parse_options(options_json: str) -> dict[str, Any]:
    """The plan's extra request fields; raises :class:`SetupFailure` (``INVALID_PLAN``)."""
    try:
        options = json.loads(options_json) if options_json else {}
    except ValueError as exc:
        raise SetupFailure(INVALID_PLAN, f"generation.options_json is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise SetupFailure(INVALID_PLAN, "generation.options_json must be a JSON object")
    return options


def _generation(
    generation: pb.GenerationParams,
    messages: Sequence[Mapping[str, Any]] = (),
    *,
    prompt: str | list[int] | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> ChatRequest:
    return ChatRequest(
        messages=messages,
        max_tokens=generation.max_tokens or None,
        temperature=generation.temperature if generation.HasField("temperature") else None,
        top_p=generation.top_p if generation.HasField("top_p") else None,
        stop=list(generation.stop) or None,
        seed=generation.seed if generation.HasField("seed") else None,
        prompt=prompt,
        tools=tools,
        options=parse_options(generation.options_json),
    )


def job_request(plan: pb.ExecutionPlan) -> ChatRequest | EmbeddingsRequest:
    """What the plan's job asks llama-server for: a chat (``/v1/chat/completions``), a legacy
    completion (``/v1/completions``) or embeddings (``/v1/embeddings``); raises
    :class:`SetupFailure` (``INVALID_PLAN``) for a plan without a job or with a malformed one."""
    kind = plan.WhichOneof("job")
    if kind == "chat":
        messages = parse_messages(plan.chat.messages_json)
        tools = _json_list(plan.chat.tools_json, "chat.tools_json") if plan.chat.tools_json else []
        return _generation(plan.generation, messages, tools=tools)
    if kind == "completion":
        which = plan.completion.WhichOneof("prompt")
        if which == "text" and plan.completion.text:
            return _generation(plan.generation, prompt=plan.completion.text)
        if which == "tokens" and plan.completion.tokens.ids:
            return _generation(plan.generation, prompt=list(plan.completion.tokens.ids))
        raise SetupFailure(INVALID_PLAN, "completion has no prompt")
    if kind == "embedding":
        texts, tokens = list(plan.embedding.texts), plan.embedding.tokens
        if texts and not tokens:
            return EmbeddingsRequest(texts)
        if tokens and not texts and all(t.ids for t in tokens):
            return EmbeddingsRequest([list(t.ids) for t in tokens])
        raise SetupFailure(INVALID_PLAN, "embedding needs texts or token id lists (not both)")
    raise SetupFailure(INVALID_PLAN, "the plan has no job (chat, completion or embedding)")


def failure_of(exc: LlamaRuntimeError) -> tuple[str, str]:
    """A generation's failure as ``(error_code, message)``: a crash, the request's fault (its
    prompt too long, or refused as invalid), or another failure of generation."""
    if isinstance(exc, RuntimeCrashedError):
        return RUNTIME_CRASHED, str(exc)
    if isinstance(exc, ContextTooLong):
        return CONTEXT_LENGTH_EXCEEDED, str(exc)
    if isinstance(exc, RequestRejected):
        return REQUEST_REJECTED, str(exc)
    return GENERATION_FAILED, str(exc)
