"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.response import Stream

from application.admission import CapacityError
from application.commands import Submission
from application.deadlines import DEADLINE_CODES
from application.job_manager import JobManager
from application.job_run import JobRun, StreamItem
from domain.model import is_model_name
from interfaces.http_auth import inference_guard
from interfaces.http_docs import (
    ApiOperation,
    ChatCompletion,
    ChatCompletionOperation,
    ModelCards,
    errors,
    success,
)
from interfaces.http_errors import ApiError, error_body, not_running
from interfaces.openai_validation import parse_chat_request
from interfaces.services import Services
from proto import CONTEXT_LENGTH_EXCEEDED

log = logging.getLogger(__name__)


_background: set[asyncio.Task[Any]] = set()


def _services(state: State) -> Services:
    return state.services  # type: ignore[no-any-return]


def _jobs(svc: Services) -> JobManager:
    jobs = svc.extras.get("jobs")
    if jobs is None:
        raise not_running("the job manager is not running")
    return jobs  # type: ignore[no-any-return]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


@get(
    "/v1/models",
    guards=[inference_guard],
    tags=["openai"],
    summary="List registered models",
    operation_class=ApiOperation,
    responses={**success(ModelCards, "The registered models"), **errors(401, 503)},
)
async def list_models(state: State) -> dict[str, Any]:
    svc = _services(state)
    rows = await asyncio.to_thread(svc.read_model.list_models)
    return {
        "object": "list",
        "data": [
            {
                "id": r["name"],
                "object": "model",
                "created": int(_epoch(r["registered_at"])),
                "owned_by": "dacp",
            }
            for r in rows
        ],
    }


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def job_error(message: str, code: str) -> ApiError:
    """A failed job as an OpenAI error: a prompt longer than the context is the request's
    fault (400 ``context_length_exceeded``, param ``messages``); a missed deadline is 504; any
    other failure of generation is 502."""
    if code == CONTEXT_LENGTH_EXCEEDED:
        return ApiError(
            400,
            f"the messages do not fit the model's context: {message}",
            param="messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    status = 504 if code in DEADLINE_CODES else 502
    return ApiError(status, message, type_="server_error", code=code)


@post(
    "/v1/chat/completions",
    guards=[inference_guard],
    tags=["openai"],
    summary="Create a chat completion, optionally streamed as server-sent events",
    status_code=200,
    operation_class=ChatCompletionOperation,
    responses={
        **success(ChatCompletion, "The completion (JSON), or with `stream: true` its chunks"),
        **errors(
            400,
            401,
            (404, "Unknown model (`model_not_found`)"),
            (413, "The body is larger than `MAX_REQUEST_BYTES` (`request_too_large`)"),
            502,
            503,
            504,
        ),
    },
)
async def chat_completions(state: State, request: Request[Any, Any, Any]) -> Response[Any]:
    svc = _services(state)
    raw = await request.body()  # at most MAX_REQUEST_BYTES: Litestar refuses more (413)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    submission = parse_chat_request(body)
    # A name no model can have is not looked up (a NUL byte would break a Postgres query).
    model = None
    if is_model_name(submission.model):
        model = await asyncio.to_thread(svc.read_model.get_model, submission.model)
    if model is None:
        raise ApiError(
            404,
            f"The model `{submission.model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    jobs = _jobs(svc)
    admitted = asyncio.ensure_future(_admit(jobs, submission, model))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({admitted, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down: the job goes with it
        admitted.cancel()
        raise
    finally:
        gone.cancel()
    if not admitted.done():
        # The client went away while queued or in setup: the job ends as JOB_CANCELLED and
        # takes no slot. Nobody reads this response.
        admitted.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await admitted
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    try:
        run, first = admitted.result()
    except CapacityError as e:
        raise ApiError(
            503,
            f"no capacity for model {submission.model}: {e}",
            type_="server_error",
            code=e.code,
            headers={"Retry-After": str(e.retry_after)},
        ) from e
    if first.kind == "error":  # nothing was sent yet: the failure keeps its real status
        raise job_error(first.error, first.error_code)
    completion_id = "chatcmpl-" + run.job_id.replace("-", "")
    created = int(time.time())
    if submission.stream:
        include_usage = bool(submission.params.get("include_usage"))
        return Stream(
            _stream(jobs, run, first, completion_id, created, submission.model, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect(jobs, run, first, completion_id, created, submission.model)


#: nginx's "client closed request": logged when a client leaves before any byte is sent.
CLIENT_CLOSED_REQUEST = 499


async def _admit(
    jobs: JobManager, submission: Submission, model: dict[str, Any]
) -> tuple[JobRun, StreamItem]:
    """Starts the job (queueing if need be) and waits for its first stream item, so that no
    response header is sent before the request is known to succeed or how it failed."""
    run = await jobs.start(submission, model)
    try:
        return run, await run.queue.get()
    except asyncio.CancelledError:
        _spawn(jobs.cancel(run.job_id, "client disconnected before the first token"))
        raise


async def _client_gone(request: Request[Any, Any, Any]) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    jobs: JobManager,
    run: JobRun,
    first: StreamItem,
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return payload

    # Content chunks are the hot path: the same JSON as chunk({"content": text}), built from
    # two constant halves around the encoded text.
    head, tail = _sse(chunk({"content": ""})).split(b'"content":""', 1)
    head += b'"content":'
    finished = False
    try:
        yield _sse(chunk({"role": "assistant", "content": ""}))
        item = first
        while True:
            if item.kind == "deltas":
                # Everything already waiting goes out in one write.
                texts = [d.text for d in item.deltas]
                waiting = _drain(run.queue, texts)
                text = "".join(texts)
                if text:
                    yield head + orjson.dumps(text) + tail
                item = waiting if waiting is not None else await run.queue.get()
                continue
            finished = True
            if item.kind == "error":
                yield _sse(error_body(item.error, "server_error", item.error_code))
                return
            assert item.outcome is not None
            yield _sse(chunk({}, item.outcome.finish_reason))
            if include_usage:
                usage = _usage(item.outcome.prompt_tokens, item.outcome.completion_tokens)
                yield _sse(
                    {
                        "id": completion_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "system_fingerprint": None,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield b"data: [DONE]\n\n"
            return
    finally:
        if not finished:
            _spawn(jobs.cancel(run.job_id, "client disconnected"))


def _drain(queue: asyncio.Queue[StreamItem], texts: list[str]) -> StreamItem | None:
    """Adds the texts of the delta items already queued; returns the first other item."""
    while not queue.empty():
        item = queue.get_nowait()
        if item.kind != "deltas":
            return item
        texts.extend(d.text for d in item.deltas)
    return None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _collect(
    jobs: JobManager,
    run: JobRun,
    first: StreamItem,
    completion_id: str,
    created: int,
    model: str,
) -> Response[Any]:
    parts: list[str] = []
    finished = False
    item = first
    try:
        while True:
            if item.kind == "deltas":
                parts.extend(d.text for d in item.deltas)
                item = await run.queue.get()
                continue
            finished = True
            if item.kind == "error":
                raise job_error(item.error, item.error_code)
            assert item.outcome is not None
            return Response(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "system_fingerprint": None,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": "".join(parts),
                                "refusal": None,
                            },
                            "logprobs": None,
                            "finish_reason": item.outcome.finish_reason,
                        }
                    ],
                    "usage": _usage(item.outcome.prompt_tokens, item.outcome.completion_tokens),
                }
            )
    finally:
        if not finished:
            _spawn(jobs.cancel(run.job_id, "client disconnected"))
