"""Small value types shared by the controller's commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from common.contract import Endpoint
from domain.api_keys import OPEN, Grant

#: How ``JOB_SUBMITTED`` records a completion's prompt and the inputs of embeddings among the
#: job's messages.
PROMPT_ROLE = "prompt"
INPUT_ROLE = "input"


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
    #: Of ``prompt_tokens``, those llama-server reused from its cache (0: none or not said).
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt as the model's chat template will see it: the OpenAI chat
    messages, and the tools offered to the model (sent to llama-server as ``tools``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TextPrompt:
    """A legacy completion's prompt: text, or token ids the server takes as they are."""

    text: str | list[int]


@dataclass(frozen=True)
class EmbeddingInputs:
    """The inputs of an embeddings request: texts, or token id lists, one vector each."""

    items: list[str] | list[list[int]]


#: What the controller counts before a request reaches a node.
Prompt = ChatPrompt | TextPrompt

#: What a job runs on: a chat's messages, a completion's prompt or the inputs of embeddings.
JobInput = ChatPrompt | TextPrompt | EmbeddingInputs


@dataclass(frozen=True)
class Caller:
    """Who asked (OpenAI's ``user``, ``safety_identifier`` and ``metadata``): recorded with the
    job, never sent to the model."""

    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None

    def recorded(self) -> dict[str, Any]:
        fields = {
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "metadata": self.metadata,
        }
        return {key: value for key, value in fields.items() if value is not None}


@dataclass(frozen=True)
class JobParams:
    """The options of a job the controller validated: the sampling fields every generation
    takes, what shapes the answer (``include_usage``, ``top_logprobs``, ``forced_tools``), who
    asked, and ``options``."""

    #: None: as many as the context holds (``capped`` makes it the slot's context).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    #: A streamed answer ends with a usage chunk.
    include_usage: bool = False
    #: The alternatives per token the answer keeps (None: no logprobs asked for).
    top_logprobs: int | None = None
    #: The tools a forced tool call names (None: no call is forced); the answer is one call.
    forced_tools: list[str] | None = None
    caller: Caller = field(default_factory=Caller)
    #: The only pass-through: llama-server request fields the controller validated and sends
    #: as they are (penalties, ``logit_bias``, ``top_k``, ``min_p``, ``repeat_penalty``,
    #: ``logprobs``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``).
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Submission:
    """A request the controller validated: which model, what the job runs on (its endpoint
    follows from that), its options, and whether the answer streams."""

    model: str
    prompt: JobInput
    params: JobParams = field(default_factory=JobParams)
    stream: bool = False
    #: What the request's API key allows (``domain/api_keys.py``); its id is recorded.
    grant: Grant = OPEN

    @property
    def endpoint(self) -> Endpoint:
        if isinstance(self.prompt, TextPrompt):
            return Endpoint.COMPLETIONS
        if isinstance(self.prompt, EmbeddingInputs):
            return Endpoint.EMBEDDINGS
        return Endpoint.CHAT

    def recorded_messages(self) -> list[dict[str, Any]]:
        """The job's content as ``JOB_SUBMITTED`` records it: a chat's messages, a completion's
        prompt as one ``prompt`` message, each input of embeddings as an ``input`` message."""
        prompt = self.prompt
        if isinstance(prompt, TextPrompt):
            return [{"role": PROMPT_ROLE, "content": prompt.text}]
        if isinstance(prompt, EmbeddingInputs):
            return [{"role": INPUT_ROLE, "content": item} for item in prompt.items]
        return prompt.messages

    def recorded_params(self) -> dict[str, Any]:
        """The job's parameters as ``JOB_SUBMITTED`` records them (the admin jobs API shows
        them): the endpoint unless a chat, what it was asked for, and who asked."""
        caller = self.params.caller.recorded()
        if self.endpoint == Endpoint.EMBEDDINGS:
            return {"endpoint": str(Endpoint.EMBEDDINGS), **caller}
        p = self.params
        options = dict(p.options)
        if isinstance(self.prompt, ChatPrompt) and self.prompt.tools:
            options["tools"] = self.prompt.tools
        recorded: dict[str, Any] = {
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stop": p.stop,
            "seed": p.seed,
            "include_usage": p.include_usage,
            "top_logprobs": p.top_logprobs,
        }
        if self.endpoint == Endpoint.COMPLETIONS:
            return {"endpoint": str(Endpoint.COMPLETIONS), **recorded, "options": options, **caller}
        return {**recorded, "forced_tools": p.forced_tools, "options": options, **caller}


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
