"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.response import Stream

from application.job_manager import JobManager, JobRun, NoCapacityError
from interfaces.http_auth import inference_guard
from interfaces.http_errors import ApiError, error_body
from interfaces.openai_validation import parse_chat_request
from interfaces.services import Services

log = logging.getLogger(__name__)

_background: set[asyncio.Task[Any]] = set()


def _services(state: State) -> Services:
    return state.services  # type: ignore[no-any-return]


def _jobs(svc: Services) -> JobManager:
    jobs = svc.extras.get("jobs")
    if jobs is None:
        raise ApiError(503, "the job manager is not running", type_="server_error")
    return jobs  # type: ignore[no-any-return]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


@get("/v1/models", guards=[inference_guard], tags=["openai"], summary="List registered models")
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


@post(
    "/v1/chat/completions",
    guards=[inference_guard],
    tags=["openai"],
    summary="Create a chat completion, optionally streamed as server-sent events",
    status_code=200,
)
async def chat_completions(state: State, request: Request[Any, Any, Any]) -> Response[Any]:
    svc = _services(state)
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    submission = parse_chat_request(body)
    model = await asyncio.to_thread(svc.read_model.get_model, submission.model)
    if model is None:
        raise ApiError(
            404,
            f"The model `{submission.model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    jobs = _jobs(svc)
    try:
        run = await jobs.start(submission, model)
    except NoCapacityError as e:
        raise ApiError(
            503,
            f"no capacity for model {submission.model}: {e}",
            type_="server_error",
            code="no_capacity",
            headers={"Retry-After": str(e.retry_after)},
        ) from e
    completion_id = "chatcmpl-" + run.job_id.replace("-", "")
    created = int(time.time())
    if submission.stream:
        include_usage = bool(submission.params.get("include_usage"))
        return Stream(
            _stream(jobs, run, completion_id, created, submission.model, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect(jobs, run, completion_id, created, submission.model)


async def _stream(
    jobs: JobManager,
    run: JobRun,
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

    finished = False
    try:
        yield _sse(chunk({"role": "assistant", "content": ""}))
        while True:
            item = await run.queue.get()
            if item.kind == "deltas":
                text = "".join(d.text for d in item.deltas)
                if text:
                    yield _sse(chunk({"content": text}))
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


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _collect(
    jobs: JobManager, run: JobRun, completion_id: str, created: int, model: str
) -> Response[Any]:
    parts: list[str] = []
    finished = False
    try:
        while True:
            item = await run.queue.get()
            if item.kind == "deltas":
                parts.extend(d.text for d in item.deltas)
                continue
            finished = True
            if item.kind == "error":
                raise ApiError(502, item.error, type_="server_error", code=item.error_code)
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
