"""What agents tell the job manager about jobs: one typed message per kind.

The gRPC bridge (``interfaces/grpc/agent_bridge.py``) turns each protobuf uplink message into one of
these, and :meth:`application.job_manager.JobManager.handle` takes the union, matching every
kind exactly once (``assert_never``: a kind added here and not handled there is a type error).
"""

from __future__ import annotations

from dataclasses import dataclass

from application.commands import Delta


@dataclass(frozen=True, slots=True)
class SetupOutcome:
    ok: bool
    error: str = ""
    error_code: str = ""
    failed_node_id: str = ""
    #: ``OUT_OF_MEMORY``: the device that ran out (its name on ``failed_node_id``) and the bytes
    #: it asked for (0: not said).
    failed_device: str = ""
    failed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AgentJobResult:
    ok: bool
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    tokens_per_second: float = 0.0
    #: Of ``prompt_tokens``, those llama-server reused from its cache (0: none or not said).
    cached_prompt_tokens: int = 0
    error: str = ""
    error_code: str = ""
    #: A result that is not a token stream, as JSON (embeddings).
    output: str = ""
    #: ``OUT_OF_MEMORY``: the node and device that ran out, and the bytes asked for.
    failed_node_id: str = ""
    failed_device: str = ""
    failed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TokensGenerated:
    """Content pieces of a job, from its primary (relayed at once, recorded in batches)."""

    job_id: str
    deltas: list[Delta]


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """An RPC worker of a job started, or failed to."""

    job_id: str
    started: bool
    host: str = ""
    port: int = 0
    error: str = ""
    error_code: str = ""
    #: ``OUT_OF_MEMORY``: the device (this node's name for it) and the bytes asked for.
    failed_device: str = ""
    failed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class SetupReported:
    """The primary validated the plan (or refused it)."""

    job_id: str
    outcome: SetupOutcome


@dataclass(frozen=True, slots=True)
class JobFinished:
    """The primary's final word on a job: completed or failed."""

    job_id: str
    result: AgentJobResult


AgentJobMessage = TokensGenerated | WorkerStatus | WorkerStopped | SetupReported | JobFinished


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a message from an agent was refused (it is dropped; the stream goes on)."""

    reason: str
    job_id: str = ""
