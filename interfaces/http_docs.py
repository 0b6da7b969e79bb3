"""What ``/schema/openapi.json`` says beyond the handlers' signatures.

Every error is OpenAI's JSON (:func:`interfaces.http_errors.error_body`); each handler lists the
statuses it can answer with (:func:`errors`). Every 503 carries ``Retry-After`` (whole seconds):
the controller is busy (no capacity, queue full or timed out, store unreachable) and the client
should try again. :class:`ApiOperation` adds that header to the documented 503s;
:class:`ChatCompletionOperation` also documents the chat request body, which the handler parses
itself (:mod:`interfaces.openai_validation`), and the streamed ``text/event-stream`` answer.

The response shapes below are documentation: handlers return plain dicts of these shapes,
and ``tests/integration/test_api_fuzz.py`` checks real responses against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)

from interfaces.openai_validation import MAX_CONTEXT, MAX_STOP, ROLES, SEED_MAX, SEED_MIN

# ------------------------------------------------------------------------------- errors


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """OpenAI's error shape, used by every error response."""

    error: ErrorDetail


DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request; `param` names the offending parameter",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    403: "Wrong admin key, or the admin API is disabled (no `ADMIN_API_KEY`)",
    404: "Not found",
    409: "Conflict with the current state",
    413: "Request too large",
    502: "The job failed on its node before the first token",
    503: "Busy: retry after `Retry-After` seconds (no capacity, queue full or timed out, "
    "event store unreachable or slow)",
    504: "The job missed a deadline before its first token",
}

#: Every admin route: its key missing (401), wrong or not configured (403).
ADMIN_KEY_ERRORS = (401, 403)


def errors(*statuses: int | tuple[int, str]) -> dict[int, ResponseSpec]:
    """Error responses in OpenAI's shape, by status (with an optional description)."""
    out: dict[int, ResponseSpec] = {}
    for item in statuses:
        status, description = item if isinstance(item, tuple) else (item, DESCRIPTIONS[item])
        out[status] = ResponseSpec(
            data_container=ErrorBody, description=description, generate_examples=False
        )
    return out


def success(shape: Any, description: str, status: int = 200) -> dict[int, ResponseSpec]:
    """A success response of ``shape`` (the handlers themselves return plain dicts)."""
    return {
        status: ResponseSpec(data_container=shape, description=description, generate_examples=False)
    }


RETRY_AFTER = OpenAPIHeader(
    schema=Schema(type=OpenAPIType.INTEGER, minimum=0),
    required=True,
    description="Seconds to wait before retrying",
)


@dataclass
class ApiOperation(Operation):
    """Documents ``Retry-After`` on the operation's 503 response."""

    def __post_init__(self) -> None:
        busy = (self.responses or {}).get("503")
        if isinstance(busy, OpenAPIResponse):
            busy.headers = {**(busy.headers or {}), "Retry-After": RETRY_AFTER}


# ------------------------------------------------------------------ response shapes


class Health(TypedDict):
    status: Literal["ok", "degraded"]
    store: bool
    live_state: bool
    store_kind: Literal["postgres", "sqlite"]
    read_model_position: int
    read_model_lag: int | None
    projection_error: str | None
    projection_skipped_events: list[int]
    controller_version: str
    protocol: str
    connected_nodes: int


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelCards(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class ChatMessageOut(TypedDict):
    role: Literal["assistant"]
    content: str
    refusal: None


class ChatChoice(TypedDict):
    index: int
    message: ChatMessageOut
    logprobs: None
    finish_reason: str | None


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class RegisteredModelRow(TypedDict):
    name: str
    sha256: str
    file_name: str
    context_size: int
    kind: Literal["chat", "embedding"]
    pooling: Literal["", "mean", "cls", "last"]
    registered_at: str
    updated_at: str


class RegisteredModels(TypedDict):
    object: Literal["list"]
    data: list[RegisteredModelRow]


class NodeView(TypedDict):
    """A node's read-model row (more fields than listed) plus its latest heartbeat."""

    node_id: str
    name: str
    state: str
    connected: bool
    heartbeat_age_seconds: float | None
    telemetry: dict[str, Any] | None


class NodeViews(TypedDict):
    object: Literal["list"]
    data: list[NodeView]


class JobFailure(TypedDict):
    phase: str | None
    reason: str | None


class JobView(TypedDict):
    """A job's read-model row (more fields than listed), its failure and its timings."""

    object: Literal["admin.job"]
    job_id: str
    state: str
    model: str
    failure: JobFailure | None
    timings: dict[str, float | None]


class JobViews(TypedDict):
    object: Literal["list"]
    data: list[JobView]
    limit: int
    offset: int
    has_more: bool


class TimelineEntry(TypedDict):
    position: int | None
    time: str
    code: str
    version: int
    state: str | None
    summary: str
    payload: dict[str, Any]


class JobTimeline(TypedDict):
    object: Literal["list"]
    job_id: str
    data: list[TimelineEntry]


class NodeTimeline(TypedDict):
    object: Literal["list"]
    node_id: str
    data: list[TimelineEntry]


class AccessRefusalRow(TypedDict):
    refusal_id: str
    at: str
    kind: Literal["enroll", "connect"]
    source: str
    node_name: str
    node_id: str
    reason: str
    security_violation: bool
    suppressed: int


class AccessRefusals(TypedDict):
    object: Literal["list"]
    data: list[AccessRefusalRow]


class IssuedTokenRow(TypedDict):
    token_id: str
    minted_at: str
    minted_by: str
    expires_at: float
    single_use: bool
    node_name: str | None
    revoked: bool
    revoked_at: str | None
    revoked_by: str | None


class IssuedTokens(TypedDict):
    object: Literal["list"]
    data: list[IssuedTokenRow]


class FeedTicket(TypedDict):
    ticket: str
    expires_at: int


class EnrollmentToken(TypedDict):
    token: str
    token_id: str
    expires_at: float
    single_use: bool
    node_name: str | None


# ---------------------------------------------------------------- chat completions


def _nullable(*types: OpenAPIType, **constraints: Any) -> Schema:
    return Schema(type=[*types, OpenAPIType.NULL], **constraints)


_STRING = Schema(type=OpenAPIType.STRING)
_TEXT_PART = Schema(
    type=OpenAPIType.OBJECT,
    properties={"type": Schema(const="text"), "text": _STRING},
    required=["type", "text"],
)
_MESSAGE = Schema(
    type=OpenAPIType.OBJECT,
    properties={
        "role": Schema(type=OpenAPIType.STRING, enum=sorted(ROLES)),
        "content": Schema(
            one_of=[
                _STRING,
                Schema(type=OpenAPIType.ARRAY, items=_TEXT_PART),
                Schema(type=OpenAPIType.NULL),
            ]
        ),
    },
    required=["role"],
)
_TOKENS = _nullable(OpenAPIType.INTEGER, minimum=1, maximum=MAX_CONTEXT)
_STOP_WORD = Schema(type=OpenAPIType.STRING, min_length=1)

#: What :func:`interfaces.openai_validation.parse_chat_request` accepts; other fields of
#: OpenAI's request are accepted and ignored.
CHAT_REQUEST = Schema(
    type=OpenAPIType.OBJECT,
    title="ChatCompletionRequest",
    properties={
        "model": Schema(type=OpenAPIType.STRING, min_length=1),
        "messages": Schema(type=OpenAPIType.ARRAY, items=_MESSAGE, min_items=1),
        "n": Schema(enum=[1, None], description="Only 1 is supported"),
        "max_tokens": _TOKENS,
        "max_completion_tokens": _TOKENS,
        "temperature": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=2),
        "top_p": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=1),
        "stop": Schema(
            one_of=[
                _STOP_WORD,
                Schema(type=OpenAPIType.ARRAY, items=_STOP_WORD, max_items=MAX_STOP),
                Schema(type=OpenAPIType.NULL),
            ]
        ),
        "seed": _nullable(OpenAPIType.INTEGER, minimum=SEED_MIN, maximum=SEED_MAX),
        "stream": Schema(type=OpenAPIType.BOOLEAN),
        "stream_options": _nullable(
            OpenAPIType.OBJECT,
            properties={"include_usage": _nullable(OpenAPIType.BOOLEAN)},
        ),
    },
    required=["model", "messages"],
)


@dataclass
class ChatCompletionOperation(ApiOperation):
    """The chat request body, and the 200 answer as JSON or as server-sent events."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.request_body = RequestBody(
            content={"application/json": OpenAPIMediaType(schema=CHAT_REQUEST)}, required=True
        )
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            ok.content = {
                **(ok.content or {}),
                "text/event-stream": OpenAPIMediaType(
                    schema=Schema(
                        type=OpenAPIType.STRING,
                        description="With `stream: true`: `data: {chat.completion.chunk}` "
                        "events, then `data: [DONE]`",
                    )
                ),
            }
