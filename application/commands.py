"""Small value types shared by the controller's commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import UUID


@dataclass(frozen=True)
class Enrollment:
    """What an agent supplies when it enrolls (already authenticated by token)."""

    name: str
    inventory: dict[str, Any]
    agent_version: str
    address: str
    rpc_port: int
    labels: dict[str, str]
    credential_sha256: str
    token_id: str
    single_use_token: bool
    slots: int = 1


@dataclass(frozen=True)
class Delta:
    """One streamed piece of generated text with its position in the job's stream."""

    seq: int
    text: str
    tokens: int = 1
    #: What came with the text besides content, as JSON (tool-call fragments, reasoning,
    #: logprobs: ``{"delta": {...}, "logprobs": {...}}``), or empty.
    extra: str = ""


@dataclass(frozen=True)
class JobOutcome:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    tokens_per_second: float
    #: A result that is not a token stream, as JSON (embeddings); relayed, never recorded.
    output: str = ""


@dataclass(frozen=True)
class Submission:
    model: str
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    stream: bool


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt as the model's chat template will see it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TextPrompt:
    """A legacy completion's prompt: text, or token ids the server takes as they are."""

    text: str | list[int]


#: What the controller counts before a request reaches a node.
Prompt = ChatPrompt | TextPrompt


@dataclass(frozen=True)
class TransferSource:
    """A node that holds a model file, where it serves it, and the ticket to fetch it."""

    node_id: str
    host: str
    port: int
    ticket: str
    #: Instead of a node: an http(s) URL of the file.
    url: str = ""


@dataclass(frozen=True)
class FetchRequest:
    """What a node is asked to fetch (``FetchModel``)."""

    transfer_id: str
    sha256: str
    file_name: str
    size_bytes: int
    sources: tuple[TransferSource, ...]
    #: Networks a URL source may be on although agents refuse them by default
    #: (``MODEL_SOURCE_ALLOWED_CIDRS``).
    allowed_source_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransferReport:
    """A node's word on one of its transfers: ``started``, ``progress``, ``completed`` or
    ``failed``."""

    transfer_id: str
    sha256: str
    state: str
    bytes_done: int = 0
    size_bytes: int = 0
    source_node_id: str = ""
    error: str = ""


@dataclass(frozen=True)
class CommandResult:
    """The store position a command's events reached (for read-your-writes waits)."""

    position: int
    aggregate_id: UUID | None = None
