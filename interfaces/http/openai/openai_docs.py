"""What ``/schema/openapi.json`` says about the OpenAI endpoints: their request bodies, which
the handlers parse themselves (:mod:`interfaces.http.openai.openai_validation`,
:mod:`interfaces.http.openai.openai_legacy`), and their answers, streamed or not.

The request schemas are exact: a body they allow is accepted, except where two fields must
agree in a way JSON Schema cannot say (a ``tool_choice`` naming a function of ``tools``,
``top_logprobs`` with ``logprobs``, unique function names); those answers are 400 with code
``invalid_combination``. ``tests/integration/test_api_fuzz.py`` holds the API to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Reference,
    RequestBody,
    Schema,
)

from interfaces.http.http_docs import ApiOperation
from interfaces.http.openai.openai_fields import (
    MAX_CONTEXT,
    MAX_LOGIT_BIAS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    MAX_STOP,
    MAX_USER_CHARS,
    SEED_MAX,
    SEED_MIN,
)
from interfaces.http.openai.openai_legacy import (
    ENCODINGS,
    MAX_COMPLETION_LOGPROBS,
    MAX_EMBEDDING_INPUTS,
    MAX_TOKEN_ID,
)
from interfaces.http.openai.openai_validation import (
    CHAT_REFUSED,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
)

# ------------------------------------------------------------------------ answers


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    #: "chat" or "embedding" (which endpoints serve it).
    kind: str
    #: Whether a node that can serve it now holds its file (or can fetch it from the store).
    available: bool


class ModelCards(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class ChatMessageOut(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall]
    reasoning_content: str


class ChatChoice(TypedDict):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class PromptTokensDetails(TypedDict):
    #: Prompt tokens llama-server took from its cache (a warm slot's matching prefix).
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[CompletionChoice]
    usage: Usage


class Embedding(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class Embeddings(TypedDict):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ------------------------------------------------------------------------ requests


def _nullable(*types: OpenAPIType, **constraints: Any) -> Schema:
    return Schema(type=[*types, OpenAPIType.NULL], **constraints)


def _object(properties: dict[str, Schema | Reference], required: list[str] | None = None) -> Schema:
    return Schema(
        type=OpenAPIType.OBJECT,
        properties=properties,
        required=required,
        additional_properties=False,
    )


_STRING = Schema(type=OpenAPIType.STRING)
_NULL = Schema(type=OpenAPIType.NULL)
_TEXT_PART = _object({"type": Schema(const="text"), "text": _STRING}, ["type", "text"])
_CONTENT = Schema(
    one_of=[_STRING, Schema(type=OpenAPIType.ARRAY, items=_TEXT_PART), _NULL],
    description="Text, or text parts (other parts are refused: `unsupported_parameter`)",
)
_TOOL_CALL = _object(
    {
        "id": _STRING,
        "type": Schema(const="function"),
        "function": _object({"name": _STRING, "arguments": _STRING}, ["name", "arguments"]),
    },
    ["id", "function"],
)
#: Fields an SDK puts on an assistant message it got back (ignored when null).
_ECHOED = {"refusal": _nullable(OpenAPIType.STRING), "audio": _NULL, "function_call": _NULL}
_MESSAGE = Schema(
    any_of=[
        _object(
            {
                "role": Schema(enum=["system", "developer", "user"]),
                "content": _CONTENT,
                "name": _STRING,
            },
            ["role"],
        ),
        _object(
            {
                "role": Schema(const="assistant"),
                "content": _CONTENT,
                "name": _STRING,
                "tool_calls": Schema(type=OpenAPIType.ARRAY, items=_TOOL_CALL, min_items=1),
                **_ECHOED,
            },
            ["role"],
        ),
        _object(
            {
                "role": Schema(const="tool"),
                "content": _CONTENT,
                "tool_call_id": Schema(type=OpenAPIType.STRING, min_length=1),
                "name": _STRING,
            },
            ["role", "tool_call_id"],
        ),
    ]
)
_FUNCTION_NAME = Schema(type=OpenAPIType.STRING, pattern=r"^[A-Za-z0-9_-]{1,64}$")


def _named_json_schema(name: Schema, schema_field: str) -> Schema:
    """A tool's function or a response format's JSON schema: ``name`` (required), a
    description, the JSON schema itself under ``schema_field``, and ``strict``."""
    return _object(
        {
            "name": name,
            "description": _STRING,
            schema_field: Schema(type=OpenAPIType.OBJECT),
            "strict": _nullable(OpenAPIType.BOOLEAN),
        },
        ["name"],
    )


_TOOL = _object(
    {
        "type": Schema(const="function"),
        "function": _named_json_schema(_FUNCTION_NAME, "parameters"),
    },
    ["type", "function"],
)
_TOKENS = _nullable(OpenAPIType.INTEGER, minimum=1, maximum=MAX_CONTEXT)
_STOP_WORD = Schema(type=OpenAPIType.STRING, min_length=1)
_STOP = Schema(
    one_of=[
        _STOP_WORD,
        Schema(type=OpenAPIType.ARRAY, items=_STOP_WORD, max_items=MAX_STOP),
        _NULL,
    ]
)
_PENALTY = _nullable(OpenAPIType.NUMBER, minimum=-2, maximum=2)
_LOGIT_BIAS = _nullable(
    OpenAPIType.OBJECT,
    max_properties=MAX_LOGIT_BIAS,
    property_names=Schema(type=OpenAPIType.STRING, pattern=r"^[0-9]+$"),
    additional_properties=Schema(type=OpenAPIType.NUMBER, minimum=-100, maximum=100),
)
_STREAM_OPTIONS = _nullable(
    OpenAPIType.OBJECT,
    properties={"include_usage": _nullable(OpenAPIType.BOOLEAN)},
    additional_properties=False,
)
_CALLER = {
    "user": Schema(type=OpenAPIType.STRING, max_length=MAX_USER_CHARS),
    "safety_identifier": Schema(type=OpenAPIType.STRING, max_length=MAX_USER_CHARS),
    "metadata": _nullable(
        OpenAPIType.OBJECT,
        max_properties=MAX_METADATA_KEYS,
        property_names=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_KEY_CHARS),
        additional_properties=Schema(type=OpenAPIType.STRING, max_length=MAX_METADATA_VALUE_CHARS),
    ),
}
_SAMPLING = {
    "temperature": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=2),
    "top_p": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=1),
    "stop": _STOP,
    "seed": _nullable(OpenAPIType.INTEGER, minimum=SEED_MIN, maximum=SEED_MAX),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "logit_bias": _LOGIT_BIAS,
    "top_k": _nullable(OpenAPIType.INTEGER, minimum=0, maximum=1 << 20),
    "min_p": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=1),
    "repeat_penalty": _nullable(OpenAPIType.NUMBER, minimum=0, maximum=10),
    "stream": Schema(type=OpenAPIType.BOOLEAN),
    "stream_options": _STREAM_OPTIONS,
    "n": Schema(enum=[1, None], description="One choice per request"),
}
_RESPONSE_FORMAT = Schema(
    one_of=[
        _object({"type": Schema(enum=["text", "json_object"])}, ["type"]),
        _object(
            {
                "type": Schema(const="json_schema"),
                "json_schema": _named_json_schema(_STRING, "schema"),
            },
            ["type", "json_schema"],
        ),
        _NULL,
    ]
)
_REFUSED = {
    name: Schema(type=OpenAPIType.NULL, description=f"Not supported: {why}")
    for name, why in CHAT_REFUSED.items()
}

CHAT_REQUEST = _object(
    {
        "model": Schema(type=OpenAPIType.STRING, min_length=1),
        "messages": Schema(type=OpenAPIType.ARRAY, items=_MESSAGE, min_items=1),
        "max_tokens": _TOKENS,
        "max_completion_tokens": _TOKENS,
        **_SAMPLING,
        "tools": _nullable(OpenAPIType.ARRAY, items=_TOOL, max_items=MAX_TOOLS),
        "tool_choice": Schema(
            one_of=[
                Schema(enum=["none", "auto", "required"]),
                _object(
                    {
                        "type": Schema(const="function"),
                        "function": _object({"name": _FUNCTION_NAME}, ["name"]),
                    },
                    ["type", "function"],
                ),
                _NULL,
            ],
            description="Needs tools; a named function must be one of them",
        ),
        "parallel_tool_calls": _nullable(OpenAPIType.BOOLEAN),
        "response_format": _RESPONSE_FORMAT,
        "logprobs": _nullable(OpenAPIType.BOOLEAN),
        "top_logprobs": _nullable(
            OpenAPIType.INTEGER,
            minimum=0,
            maximum=MAX_TOP_LOGPROBS,
            description="Needs logprobs: true",
        ),
        "modalities": Schema(one_of=[Schema(type=OpenAPIType.ARRAY, const=["text"]), _NULL]),
        "store": Schema(enum=[False, None], description="Jobs are recorded as events"),
        **_CALLER,
        **_REFUSED,
    },
    ["model", "messages"],
)
_INPUT_TEXT = Schema(type=OpenAPIType.STRING, min_length=1)
_INPUT_TOKENS = Schema(
    type=OpenAPIType.ARRAY,
    items=Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=MAX_TOKEN_ID),
    min_items=1,
)
COMPLETION_REQUEST = _object(
    {
        "model": Schema(type=OpenAPIType.STRING, min_length=1),
        "prompt": Schema(
            one_of=[
                _INPUT_TEXT,
                _INPUT_TOKENS,
                Schema(type=OpenAPIType.ARRAY, items=_INPUT_TEXT, min_items=1, max_items=1),
                Schema(type=OpenAPIType.ARRAY, items=_INPUT_TOKENS, min_items=1, max_items=1),
            ],
            description="One prompt: text or token ids (a batch of one)",
        ),
        "max_tokens": _TOKENS,
        **_SAMPLING,
        "logprobs": _nullable(OpenAPIType.INTEGER, minimum=0, maximum=MAX_COMPLETION_LOGPROBS),
        "best_of": Schema(enum=[1, None]),
        "echo": Schema(enum=[False, None], description="Not supported"),
        "suffix": Schema(type=OpenAPIType.NULL, description="Not supported"),
        "user": _CALLER["user"],
    },
    ["model", "prompt"],
)
EMBEDDINGS_REQUEST = _object(
    {
        "model": Schema(type=OpenAPIType.STRING, min_length=1),
        "input": Schema(
            one_of=[
                _INPUT_TEXT,
                Schema(
                    type=OpenAPIType.ARRAY,
                    items=_INPUT_TEXT,
                    min_items=1,
                    max_items=MAX_EMBEDDING_INPUTS,
                ),
                _INPUT_TOKENS,
                Schema(
                    type=OpenAPIType.ARRAY,
                    items=_INPUT_TOKENS,
                    min_items=1,
                    max_items=MAX_EMBEDDING_INPUTS,
                ),
            ]
        ),
        "encoding_format": _nullable(OpenAPIType.STRING, enum=[*ENCODINGS, None]),
        "dimensions": Schema(type=OpenAPIType.NULL, description="Not supported"),
        "user": _CALLER["user"],
    },
    ["model", "input"],
)


def _body_operation(schema: Schema, events: str) -> type[ApiOperation]:
    @dataclass
    class BodyOperation(ApiOperation):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.request_body = RequestBody(
                content={"application/json": OpenAPIMediaType(schema=schema)}, required=True
            )
            ok = (self.responses or {}).get("200")
            if events and isinstance(ok, OpenAPIResponse):
                ok.content = {
                    **(ok.content or {}),
                    "text/event-stream": OpenAPIMediaType(
                        schema=Schema(type=OpenAPIType.STRING, description=events)
                    ),
                }

    return BodyOperation


ChatCompletionOperation = _body_operation(
    CHAT_REQUEST,
    "With `stream: true`: `data: {chat.completion.chunk}` events, then `data: [DONE]`",
)
CompletionOperation = _body_operation(
    COMPLETION_REQUEST,
    "With `stream: true`: `data: {text_completion}` events, then `data: [DONE]`",
)
EmbeddingsOperation = _body_operation(EMBEDDINGS_REQUEST, "")
