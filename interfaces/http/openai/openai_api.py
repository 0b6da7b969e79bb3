"""The OpenAI-compatible API: ``POST /v1/chat/completions``, ``/v1/completions`` and
``/v1/embeddings``, ``GET /v1/models`` and ``/v1/models/{id}``.

Requests are validated field by field (:mod:`interfaces.http.openai.openai_validation`,
:mod:`interfaces.http.openai.openai_legacy`); answers are built by
:mod:`interfaces.http.openai.openai_responses`. No response header is sent before the job's first
token or its failure, so errors keep their real status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import orjson
from litestar import Request, Response, get, post
from litestar.params import PathParameter

from application.admission import CapacityError
from application.commands import JobOutcome, Submission
from application.context_guard import ContextLengthExceeded
from application.deadlines import DEADLINE_CODES
from application.job_manager import JobManager
from application.job_run import JobRun, StreamItem
from application.model_transfers import TransferCoordinator
from application.read_models import proven_holders
from application.store_guard import STORE_UNAVAILABLE
from application.timeline import CHAT_COMPLETION_ID_PREFIX, COMPLETION_ID_PREFIX, answer_id
from common.contract import CONTEXT_LENGTH_EXCEEDED, OUT_OF_MEMORY, REQUEST_REJECTED
from domain.api_keys import Grant
from domain.model import CHAT, EMBEDDING, MODEL_NAME_PATTERN, is_model_name
from domain.states import NodeState
from interfaces.http.event_stream_response import EventStream
from interfaces.http.http_auth import inference_guard
from interfaces.http.http_docs import ApiOperation, errors, success
from interfaces.http.http_errors import ApiError, ErrorCode, not_running
from interfaces.http.inference_call import InferenceCall
from interfaces.http.openai.openai_docs import (
    ChatCompletion,
    ChatCompletionOperation,
    Completion,
    CompletionOperation,
    Embeddings,
    EmbeddingsOperation,
    ModelCard,
    ModelCards,
)
from interfaces.http.openai.openai_legacy import (
    parse_completion_request,
    parse_embeddings_request,
    prompt_of,
)
from interfaces.http.openai.openai_limits import KeyCharge, key_charge
from interfaces.http.openai.openai_responses import (
    Answer,
    ChatStream,
    Collected,
    CompletionStream,
    chat_message,
    collect,
    completion,
    embeddings,
    stream_events,
)
from interfaces.http.openai.openai_validation import parse_chat_request
from interfaces.services import Provided, Services

log = logging.getLogger(__name__)


_background: set[asyncio.Task[Any]] = set()


def _running(jobs: JobManager | None) -> JobManager:
    if jobs is None:
        raise not_running("the job manager is not running")
    return jobs


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


#: Node states in which a node that holds a model's file can serve it now.
_SERVING = {NodeState.READY.value, NodeState.BUSY.value, NodeState.DEGRADED.value}


async def _cards(
    svc: Services, transfers: TransferCoordinator | None, grant: Grant
) -> list[ModelCard]:
    """The cards of the models the request's key may use."""
    models, nodes = await asyncio.gather(
        asyncio.to_thread(svc.read_model.list_models), asyncio.to_thread(svc.read_model.list_nodes)
    )
    serving = [n for n in nodes if n["state"] in _SERVING and not n.get("drain_requested")]
    rows = {n["node_id"]: n for n in nodes}

    def held(row: dict[str, Any]) -> bool:
        """A node in service proved it holds the file (a node's report alone is not)."""
        holders = proven_holders(row, rows, frozenset(_SERVING))
        return any(not n.get("drain_requested") for n in holders)

    def fetchable(row: dict[str, Any]) -> bool:
        """Only the controller's store holds the file: a node in service fetches it first."""
        return bool(serving) and transfers is not None and transfers.stores(row)

    return [
        {
            "id": r["name"],
            "object": "model",
            "created": int(_epoch(r["registered_at"])),
            "owned_by": "dacp",
            "kind": r.get("kind") or CHAT,
            "available": held(r) or fetchable(r),
        }
        for r in models
        if grant.may_use(r["name"])
    ]


@get(
    "/v1/models",
    guards=[inference_guard],
    tags=["openai"],
    summary=(
        "List registered models (`available`: some node in service holds the file now, or "
        "can fetch it from the controller's model store)"
    ),
    operation_class=ApiOperation,
    responses={**success(ModelCards, "The registered models"), **errors(401, 503)},
)
async def list_models(
    svc: Provided[Services], transfers: Provided[TransferCoordinator | None], grant: Provided[Grant]
) -> dict[str, Any]:
    return {"object": "list", "data": await _cards(svc, transfers, grant)}


@get(
    "/v1/models/{model:path}",
    guards=[inference_guard],
    tags=["openai"],
    summary="One registered model",
    operation_class=ApiOperation,
    responses={
        **success(ModelCard, "The model"),
        **errors(400, 401, (404, "Unknown model (`model_not_found`)"), 503),
    },
)
async def get_model(
    svc: Provided[Services],
    transfers: Provided[TransferCoordinator | None],
    grant: Provided[Grant],
    model: Annotated[
        str,
        PathParameter(description=f"The model's name (`{MODEL_NAME_PATTERN}`; it may hold `/`)"),
    ],
) -> ModelCard:
    name = model.removeprefix("/")
    for card in await _cards(svc, transfers, grant):
        if card["id"] == name:
            return card
    raise ApiError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        param="model",
        code=ErrorCode.MODEL_NOT_FOUND,
    )


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def job_error(message: str, code: str) -> ApiError:
    """A failed job as an OpenAI error: a prompt longer than the context is the request's
    fault (400 ``context_length_exceeded``, param ``messages``); a missed deadline is 504; the
    store going away is 503 ``store_unavailable`` with Retry-After, a device out of memory
    503 ``out_of_memory``; any other failure of generation is 502."""
    if code == CONTEXT_LENGTH_EXCEEDED:
        return ApiError(
            400,
            f"the messages do not fit the model's context: {message}",
            param="messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if code == REQUEST_REJECTED:
        return ApiError(400, f"the model's server refused the request: {message}", code=code)
    if code == STORE_UNAVAILABLE:
        return ApiError(503, message, type_="server_error", code=code, headers={"Retry-After": "2"})
    if code == OUT_OF_MEMORY:
        # A device ran out of memory after the job started: the cluster's fault, and the next
        # plan gives that device less (application/device_budgets.py), so a retry may succeed.
        return ApiError(503, message, type_="server_error", code=code, headers={"Retry-After": "2"})
    status = 504 if code in DEADLINE_CODES else 502
    return ApiError(status, message, type_="server_error", code=code)


_CHAT_ERRORS = errors(
    400,
    401,
    (404, "Unknown model (`model_not_found`), or one for another endpoint"),
    (413, "The body is larger than `MAX_REQUEST_BYTES` (`request_too_large`)"),
    (
        429,
        "A limit of the key: a rate or its concurrent requests (`rate_limit_exceeded`), or "
        "its monthly token budget (`insufficient_quota`); retry after `Retry-After` seconds",
    ),
    502,
    503,
    504,
)


def _inference(
    path: str, summary: str, operation: type[ApiOperation], success_shape: Any, success_says: str
) -> post:
    """The route of an inference endpoint: POST ``path`` (200 on success, ``success_shape``
    as ``success_says``, or one of the generating endpoints' errors) for an inference key."""
    return post(
        path,
        guards=[inference_guard],
        tags=["openai"],
        summary=summary,
        status_code=200,
        operation_class=operation,
        responses={**success(success_shape, success_says), **_CHAT_ERRORS},
    )


#: What a generating endpoint answers on success.
_GENERATED = "The completion (JSON), or with `stream: true` its chunks"


@_inference(
    "/v1/chat/completions",
    "Create a chat completion, optionally streamed as server-sent events",
    ChatCompletionOperation,
    ChatCompletion,
    _GENERATED,
)
async def chat_completions(
    call: Provided[InferenceCall], request: Request[Any, Any, Any]
) -> Response[Any]:
    submission = dataclasses.replace(parse_chat_request(await _body(request)), grant=call.grant)
    return await _generate(
        call, request, submission, CHAT_COMPLETION_ID_PREFIX, ChatStream, chat_message
    )


@_inference(
    "/v1/completions",
    "Create a (legacy) completion of a prompt, optionally streamed",
    CompletionOperation,
    Completion,
    _GENERATED,
)
async def completions(
    call: Provided[InferenceCall], request: Request[Any, Any, Any]
) -> Response[Any]:
    parsed = parse_completion_request(await _body(request))
    submission = dataclasses.replace(parsed, grant=call.grant)
    return await _generate(
        call, request, submission, COMPLETION_ID_PREFIX, CompletionStream, completion
    )


@_inference(
    "/v1/embeddings",
    "Embed a batch of inputs with an embedding model",
    EmbeddingsOperation,
    Embeddings,
    "One vector per input, in order",
)
async def create_embeddings(
    call: Provided[InferenceCall], request: Request[Any, Any, Any]
) -> Response[Any]:
    parsed, encoding = parse_embeddings_request(await _body(request))
    submission = dataclasses.replace(parsed, grant=call.grant)
    charge = await key_charge(call.svc.limiter, submission.grant)
    try:
        started = await _started(call, request, submission, EMBEDDING)
        if isinstance(started, Response):
            return started
        manager, run, first = started
        _, outcome = await _collected(manager, run, first)
        charge.settle(outcome.prompt_tokens, 0)
        return Response(embeddings(submission.model, outcome, encoding), headers=charge.headers)
    finally:
        charge.settle(0, 0)  # ended otherwise: nothing known to charge


async def _generate(
    call: InferenceCall,
    request: Request[Any, Any, Any],
    submission: Submission,
    prefix: str,
    events: type[ChatStream] | type[CompletionStream],
    answer_of: Callable[[Answer, Collected, JobOutcome], dict[str, Any]],
) -> Response[Any]:
    """A chat or legacy completion: streamed as ``events``, or collected by ``answer_of``.
    The key's limits are checked before the job exists; its hold on them is settled once
    (here, or by the stream) however the request ends."""
    charge = await key_charge(call.svc.limiter, submission.grant)
    run: JobRun | None = None
    handed_over = False  # to the stream, which settles when it ends
    try:
        started = await _started(call, request, submission, CHAT)
        if isinstance(started, Response):
            return started
        manager, run, first = started
        answer = await _answer(manager, run, first, submission, prefix, events, answer_of, charge)
        handed_over = isinstance(answer, EventStream)
        return answer
    finally:
        if not handed_over:
            charge.settle(0, _relayed(run))


async def _answer(
    manager: JobManager,
    run: JobRun,
    first: StreamItem,
    submission: Submission,
    prefix: str,
    events: type[ChatStream] | type[CompletionStream],
    answer_of: Callable[[Answer, Collected, JobOutcome], dict[str, Any]],
    charge: KeyCharge,
) -> Response[Any]:
    answer = Answer(
        answer_id(prefix, run.job_id),
        int(time.time()),
        submission.model,
        include_usage=submission.params.include_usage,
        forced_tools=submission.params.forced_tools,
        top_logprobs=submission.params.top_logprobs,
    )
    if submission.stream:
        return _events(manager, run, first, events(answer), charge)
    collected, outcome = await _collected(manager, run, first, answer.top_logprobs)
    charge.settle(outcome.prompt_tokens, outcome.completion_tokens)
    return Response(answer_of(answer, collected, outcome), headers=charge.headers)


def _relayed(run: JobRun | None) -> int:
    """The tokens a job relayed so far (its usage when it ended without an outcome)."""
    return 0 if run is None else run.next_seq


async def _body(request: Request[Any, Any, Any]) -> Any:
    raw = await request.body()  # at most MAX_REQUEST_BYTES: Litestar refuses more (413)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code=ErrorCode.INVALID_JSON
        ) from e


async def _model(svc: Services, name: str, kind: str, grant: Grant) -> dict[str, Any]:
    # A name no model can have is not looked up (a NUL byte would break a Postgres query); a
    # model the key may not use is answered as one that does not exist.
    model = None
    if is_model_name(name) and grant.may_use(name):
        rows = svc.model_rows
        if rows is not None:  # in memory: no thread hop on the first token's path
            model = rows.get_model(name)
        else:
            model = await asyncio.to_thread(svc.read_model.get_model, name)
    if model is None:
        raise ApiError(
            404,
            f"The model `{name}` does not exist or you do not have access to it.",
            param="model",
            code=ErrorCode.MODEL_NOT_FOUND,
        )
    if (model.get("kind") or CHAT) != kind:
        use = "/v1/embeddings" if kind == CHAT else "/v1/chat/completions or /v1/completions"
        # OpenAI answers a model used on the wrong endpoint with 404 too.
        raise ApiError(
            404,
            f"The model `{name}` is {'an embedding' if kind == CHAT else 'a chat'} model: "
            f"use it with {use}",
            param="model",
            code=ErrorCode.MODEL_NOT_SUPPORTED,
        )
    return model


async def _started(
    call: InferenceCall,
    request: Request[Any, Any, Any],
    submission: Submission,
    kind: str,
) -> tuple[JobManager, JobRun, StreamItem] | Response[Any]:
    """The job, admitted and with its first stream item (or its failure raised); a 499
    response when the client left first."""
    svc = call.svc
    model = await _model(svc, submission.model, kind, submission.grant)
    prompt = prompt_of(submission)
    if prompt is not None:
        try:
            await svc.context_guard.check(model, prompt)
        except ContextLengthExceeded as e:
            raise ApiError(400, str(e), param=e.param, code=CONTEXT_LENGTH_EXCEEDED) from e
    manager = _running(call.jobs)  # after the checks a request fails without a job manager
    # The job is admitted in this task (a task of its own cost the first token a hop); a
    # watcher cancels it when the client goes away while it is queued or in setup.
    handling = asyncio.current_task()
    assert handling is not None
    admitting = True
    left = False

    def client_gone(watcher: asyncio.Future[None]) -> None:
        nonlocal left
        if admitting and not watcher.cancelled() and watcher.exception() is None:
            left = True
            handling.cancel()

    gone = asyncio.ensure_future(_client_gone(request))
    gone.add_done_callback(client_gone)
    try:
        run, first = await _admit(manager, submission, model)
    except asyncio.CancelledError:
        if not left:
            raise  # the server is shutting down: the job goes with it
        # The client went away while queued or in setup: the job ended as JOB_CANCELLED and
        # takes no slot. Nobody reads this response.
        handling.uncancel()
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    except CapacityError as e:
        raise ApiError(
            503,
            f"no capacity for model {submission.model}: {e}",
            type_="server_error",
            code=e.code,
            headers={"Retry-After": str(e.retry_after)},
        ) from e
    finally:
        admitting = False
        gone.cancel()
    if first.kind == "error":  # nothing was sent yet: the failure keeps its real status
        raise job_error(first.error, first.error_code)
    return manager, run, first


def _events(
    jobs: JobManager,
    run: JobRun,
    first: StreamItem,
    events: ChatStream | CompletionStream,
    charge: KeyCharge,
) -> EventStream:
    def abandon() -> None:
        _spawn(jobs.cancel(run.job_id, "client disconnected"))

    def completed(outcome: JobOutcome) -> None:
        charge.settle(outcome.prompt_tokens, outcome.completion_tokens)

    async def settled() -> AsyncIterator[bytes]:
        """The events; the key's hold settled when they end, however they end."""
        try:
            async for event in stream_events(run, first, events, abandon, completed):
                yield event
        finally:
            charge.settle(0, _relayed(run))

    return EventStream(
        settled(),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **charge.headers},
    )


async def _collected(
    jobs: JobManager, run: JobRun, first: StreamItem, top: int | None = None
) -> tuple[Collected, JobOutcome]:
    finished = False
    try:
        result = await collect(run, first, job_error, top)
        finished = True
        return result
    except ApiError:
        finished = True
        raise
    finally:
        if not finished:
            _spawn(jobs.cancel(run.job_id, "client disconnected"))


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
