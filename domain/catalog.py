"""The event catalog (DESIGN.md §5): catalog code → event class, for both aggregates."""

from __future__ import annotations

from domain.job import Job
from domain.node import Node

NODE_EVENTS: tuple[type[Node.Event] | type[Node.Enrolled], ...] = (
    Node.Enrolled,
    Node.BecameReady,
    Node.ResourcesReported,
    Node.HeartbeatTimedOut,
    Node.WentOffline,
    Node.Recovered,
    Node.DrainRequested,
    Node.Drained,
    Node.Resumed,
    Node.ErrorReported,
    Node.RpcWorkerStarted,
    Node.RpcWorkerStopped,
    Node.SecurityViolation,
    Node.JobAssigned,
    Node.JobReleased,
)

JOB_EVENTS: tuple[type[Job.Event] | type[Job.Submitted], ...] = (
    Job.Submitted,
    Job.Planned,
    Job.Replanned,
    Job.Dispatched,
    Job.SetupValidated,
    Job.TokenStreamChunk,
    Job.Completed,
    Job.Failed,
    Job.Cancelled,
)

CATALOG: dict[str, type] = {cls.code: cls for cls in (*NODE_EVENTS, *JOB_EVENTS)}

#: The seven events the product document names; they must always exist.
SEED_EVENTS = (
    "NODE_ENROLLED",
    "HEARTBEAT_TIMEOUT",
    "JOB_DISPATCHED",
    "RPC_WORKER_STARTED",
    "TOKEN_STREAM_CHUNK",
    "JOB_COMPLETED",
    "NODE_DRAINED",
)


def code_of(event: object) -> str:
    """The catalog code of a domain event (its class name for a snapshot)."""
    return str(getattr(type(event), "code", "") or type(event).__name__)
