"""What ``/schema/openapi.json`` says beyond the handlers' signatures.

Every error is OpenAI's JSON (:func:`interfaces.http.http_errors.error_body`); each handler lists
the statuses it can answer with (:func:`errors`). Every 503 carries ``Retry-After`` (whole seconds):
the controller is busy (no capacity, queue full or timed out, store unreachable) and the client
should try again. :class:`ApiOperation` adds that header to the documented 503s;
the OpenAI endpoints' request bodies, which their handlers parse themselves, are documented by
:mod:`interfaces.http.openai.openai_docs`.

The response shapes below are documentation: handlers return plain dicts of these shapes,
and ``tests/integration/test_api_fuzz.py`` checks real responses against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Schema,
)
from litestar.params import KwargDefinition

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
    """Documents ``Retry-After`` on the operation's 429 and 503 responses."""

    def __post_init__(self) -> None:
        for status in ("429", "503"):
            busy = (self.responses or {}).get(status)
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


class StoredModelFile(TypedDict):
    """The model's file in the controller's model store, as read there (MODEL_STORED)."""

    size_bytes: int
    layers: int
    context_length: int
    kv_bytes_per_token: int
    architecture: str


class RegisteredModelRow(TypedDict):
    name: str
    sha256: str
    file_name: str
    context_size: int
    kind: Literal["chat", "embedding"]
    pooling: Literal["", "mean", "cls", "last"]
    #: http(s) URLs the file can be fetched from.
    sources: list[str]
    #: The nodes that proved they hold the file (neither revoked nor offline).
    held_by: list[str]
    #: The file in the controller's model store (``dacp models add``), or null.
    stored: StoredModelFile | None
    #: The file's size and shape the planner uses (null: not known yet), never a node's word.
    shape: StoredModelFile | None
    #: Where they come from: "store", or the id of the node whose proof fixed them.
    shape_from: str | None
    registered_at: str
    updated_at: str


class ModelPullRow(TypedDict):
    node_id: str
    transfer_id: str
    sources: list[str]


class ModelEvictionRow(TypedDict):
    node_id: str
    model: str
    file_name: str


class ModelPulls(TypedDict):
    transfers: list[ModelPullRow]


class RegisteredModels(TypedDict):
    object: Literal["list"]
    data: list[RegisteredModelRow]


class TransferFailure(TypedDict):
    """A model transfer onto the node that failed (MODEL_TRANSFER_FAILED), as far as it got."""

    transfer_id: str
    sha256: str
    file_name: Annotated[
        str | None,
        KwargDefinition(
            description="The file's name, from its MODEL_TRANSFER_STARTED (null: "
            "the start is not known)"
        ),
    ]
    error: Annotated[str, KwargDefinition(description="Why it failed, as the node said")]
    failed_at: Annotated[str, KwargDefinition(description="When it failed (ISO 8601)")]
    started_at: Annotated[
        str | None, KwargDefinition(description="When it started (ISO 8601; null: not known)")
    ]
    bytes_done: Annotated[
        int, KwargDefinition(description="Bytes fetched when it failed (its last progress)")
    ]
    size_bytes: Annotated[
        int,
        KwargDefinition(
            description="The file's size (0: not known, as of a URL that never answered)"
        ),
    ]
    sources: Annotated[
        list[str],
        KwargDefinition(description="Where it was to come from, in order: node ids and URLs"),
    ]


class NodeDevice(TypedDict):
    """A compute device of the node as its llama.cpp build sees it (NVML merged in)."""

    name: Annotated[
        str,
        KwargDefinition(description="llama.cpp's name on the node: CUDA0, Vulkan1, MTL0, CPU"),
    ]
    description: Annotated[str, KwargDefinition(description="e.g. NVIDIA H100 80GB HBM3")]
    kind: Annotated[
        Literal["gpu", "cpu"], KwargDefinition(description="cpu: the host itself (its RAM)")
    ]
    memory_total_bytes: int
    memory_free_bytes: Annotated[
        int,
        KwargDefinition(description="Free now: the latest heartbeat's figure, else the report's"),
    ]
    uuid: Annotated[str, KwargDefinition(description="NVML's UUID of the GPU, or empty")]


class NodeLlama(TypedDict):
    """The node's llama.cpp build as it describes itself (empty: not said)."""

    version: Annotated[str, KwargDefinition(description="`llama-server --version`")]
    backend: Annotated[
        str, KwargDefinition(description="cpu, cuda, vulkan, metal, or custom (the node's own)")
    ]
    rpc_protocol: Annotated[
        str, KwargDefinition(description="ggml RPC protocol version, e.g. 7.0.0")
    ]


class NodeView(TypedDict):
    """A node's read-model row (more fields than listed) plus its latest heartbeat."""

    node_id: str
    name: str
    state: str
    connected: bool
    heartbeat_age_seconds: float | None
    telemetry: dict[str, Any] | None
    transfer_failures: Annotated[
        list[TransferFailure],
        KwargDefinition(
            description="The node's last failed model transfers, newest first (at most 3); a "
            "later completed transfer of the same model (sha256) takes that model's out"
        ),
    ]
    devices: Annotated[
        list[NodeDevice],
        KwargDefinition(
            description="The compute devices its llama.cpp build sees, the host CPU last "
            "(empty: the node runs no llama.cpp, or reported none)"
        ),
    ]
    llama: NodeLlama


class NodeViews(TypedDict):
    object: Literal["list"]
    data: list[NodeView]


class JobFailure(TypedDict):
    phase: str | None
    reason: str | None


class JobRoute(TypedDict):
    """How the job's server was chosen (``application/prefix_routing.py``)."""

    #: hit: the server held part of the prompt; miss: none did, or each was too busy.
    prefix: Literal["hit", "miss"]
    #: Characters of the prompt the chosen server held (in 256-character blocks).
    matched_chars: int


class JobView(TypedDict):
    """A job's read-model row (more fields than listed), its failure and its timings."""

    object: Literal["admin.job"]
    job_id: str
    state: str
    model: str
    failure: JobFailure | None
    timings: dict[str, float | None]
    #: Null for embeddings, for jobs not yet dispatched and for jobs recorded before routing.
    route: JobRoute | None
    #: Of ``prompt_tokens``, those llama-server took from its cache (null until completed).
    cached_prompt_tokens: int | None


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


class ApiKeyLimits(TypedDict):
    """A key's limits; null: no limit."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    concurrent_requests: int | None
    monthly_tokens: int | None


class ApiKeyRow(TypedDict):
    """A managed inference key as the views hold it (never the key, nor its hash)."""

    id: str
    name: str
    owner: str
    #: null: every model.
    models: list[str] | None
    limits: ApiKeyLimits
    priority: Literal["interactive", "batch"]
    expires_at: str | None
    created_at: str
    updated_at: str
    revoked: bool
    revoked_at: str | None
    revoked_by: str | None
    revoke_reason: str | None
    #: Neither revoked nor expired now.
    active: bool


class NewApiKey(ApiKeyRow):
    """A key just created, with its text: shown this once, never again."""

    key: str


class ApiKeys(TypedDict):
    object: Literal["list"]
    data: list[ApiKeyRow]


class FeedTicket(TypedDict):
    ticket: str
    expires_at: int
    session_ends_at: int


class EnrollmentToken(TypedDict):
    token: str
    token_id: str
    expires_at: float
    single_use: bool
    node_name: str | None


class DevicePointView(TypedDict):
    name: str
    memory_total_bytes: int
    memory_free_bytes: int


class NodePointView(TypedDict):
    node_id: str
    name: str
    #: Jobs on the node when the sample was taken, and how many it runs at once.
    busy_slots: int
    slots: int
    cpu_percent: float | None
    devices: list[DevicePointView]


class HistorySample(TypedDict):
    """The cluster over the interval that ends at ``time`` (unix seconds)."""

    time: float
    tokens_per_second: float
    #: Over the requests whose first token was relayed in the interval (null: none was).
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    queue_depth: int
    nodes: list[NodePointView]


class MetricsHistoryView(TypedDict):
    object: Literal["list"]
    #: Seconds between samples (METRICS_HISTORY_INTERVAL), and how many are kept.
    interval_seconds: float
    points: int
    data: list[HistorySample]


class AgentSetup(TypedDict):
    #: ``host:port`` for ``node-agent --controller-url``.
    controller_url: str
    #: False: the controller runs GRPC_INSECURE (agents need ``--insecure``).
    tls: bool
    #: True: the control channel listens on loopback (GRPC_HOST), out of other machines' reach.
    loopback_only: bool
    #: False: no NODE_ENROLLMENT_SECRET, so no token can be minted.
    enrollment_enabled: bool
