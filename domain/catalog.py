"""The event catalog: catalog code → event class, for every aggregate.

Each code is documented in docs/reference.md, 'Event catalogue'.
"""

from __future__ import annotations

from domain.access_refusal import AccessRefusal
from domain.api_key import ApiKey
from domain.issued_token import IssuedToken
from domain.job import Job
from domain.model import RegisteredModel
from domain.node import Node
from domain.token_redemption import TokenRedemption

NODE_EVENTS: tuple[type[Node.Event] | type[Node.Enrolled], ...] = (
    Node.Enrolled,
    Node.BecameReady,
    Node.ResourcesReported,
    Node.HeartbeatTimedOut,
    Node.WentOffline,
    Node.Stopping,
    Node.Stopped,
    Node.Recovered,
    Node.DrainRequested,
    Node.Drained,
    Node.Resumed,
    Node.ErrorReported,
    Node.RpcWorkerStarted,
    Node.RpcWorkerStopped,
    Node.RuntimeRetired,
    Node.LinksMeasured,
    Node.ModelTransferStarted,
    Node.ModelTransferProgressed,
    Node.ModelTransferCompleted,
    Node.ModelTransferFailed,
    Node.ModelEvicted,
    Node.ModelProven,
    Node.ModelClaimRefused,
    Node.SecurityViolation,
    Node.MessageRejected,
    Node.Revoked,
    Node.JobAssigned,
    Node.JobReleased,
)

JOB_EVENTS: tuple[type[Job.Event] | type[Job.Submitted], ...] = (
    Job.Submitted,
    Job.Queued,
    Job.Planned,
    Job.Replanned,
    Job.Dispatched,
    Job.SetupValidated,
    Job.TokenStreamChunk,
    Job.Completed,
    Job.Failed,
    Job.Rejected,
    Job.Cancelled,
)

OTHER_EVENTS: tuple[type, ...] = (
    AccessRefusal.Refused,
    RegisteredModel.Registered,
    RegisteredModel.Updated,
    RegisteredModel.SourceAdded,
    RegisteredModel.SourceRemoved,
    RegisteredModel.Stored,
    RegisteredModel.Unstored,
    RegisteredModel.ShapeFixed,
    TokenRedemption.Redeemed,
    IssuedToken.Minted,
    IssuedToken.Revoked,
    ApiKey.Created,
    ApiKey.Changed,
    ApiKey.Revoked,
)

CATALOG: dict[str, type] = {
    str(getattr(cls, "code")): cls  # noqa: B009 - every catalog class has a code
    for cls in (*NODE_EVENTS, *JOB_EVENTS, *OTHER_EVENTS)
}

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
