"""What the job manager keeps about one request while it runs, and what its client reads.

:class:`JobRun` is the in-memory state of one job in this controller (its plan, the futures of
its setup, the queue its HTTP response reads); :class:`StreamItem` is one entry of that queue.
The durable record is the job's events; nothing here outlives the controller process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

from application.admission import CapacityError, Ticket
from application.agent_messages import SetupOutcome
from application.commands import Delta, JobOutcome, Submission
from common.contract import JobErrorCode
from domain.placement import HOST_DEVICE, ExecutionPlan


class NoCapacityError(CapacityError):
    """No plan could be made or set up, and waiting would not help (HTTP 503)."""

    code = JobErrorCode.NO_CAPACITY


@dataclass(frozen=True)
class Unplaced:
    """No plan now. ``transient``: one would fit if busy slots were free, so waiting helps."""

    reason: str
    transient: bool


@dataclass(frozen=True)
class OutOfMemory:
    """A device that ran out of memory running a plan: its node, its name there, what the plan
    gave it and what llama.cpp said it asked for (0: not said)."""

    node_id: str
    device: str
    planned_bytes: int
    asked_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "device": self.device,
            "planned_bytes": self.planned_bytes,
            "asked_bytes": self.asked_bytes,
        }

    def describe(self, label: str) -> str:
        asked = f", asked for {self.asked_bytes} bytes" if self.asked_bytes else ""
        return (
            f"device {self.device} of node {label} ran out of memory (the plan gave it "
            f"{self.planned_bytes} bytes{asked})"
        )


def out_of_memory_in(
    plan: ExecutionPlan, node_id: str, device: str, asked_bytes: int
) -> OutOfMemory:
    """What ``plan`` gave ``device`` of ``node_id``: the device's own share when the plan names
    it; else (a device the agent could not name, or a plan on the primary's CPU alone) the
    node's only device in the plan, or its host memory with the node's whole share."""
    named = [d for d in plan.devices if d.node_id == node_id]
    match = [d for d in named if d.device == device] or (named if len(named) == 1 else [])
    if match:
        return OutOfMemory(node_id, match[0].device, match[0].assigned_bytes, asked_bytes)
    node_bytes = plan.assigned_bytes.get(node_id, 0)
    return OutOfMemory(node_id, device or HOST_DEVICE, node_bytes, asked_bytes)


@dataclass(frozen=True)
class SetupFailure:
    """Why one plan's setup failed: the reason, the node to blame ("" for none), and the
    device that ran out of memory when that was why (then the node is not excluded: the
    device's budget is lowered instead)."""

    reason: str
    blamed: str
    out_of_memory: OutOfMemory | None = None


@dataclass(frozen=True)
class StreamItem:
    """What the client side reads from a job's queue, in order."""

    kind: Literal["deltas", "done", "error"]
    deltas: tuple[Delta, ...] = ()
    outcome: JobOutcome | None = None
    error: str = ""
    error_code: str = ""


@dataclass
class JobRun:
    job_id: str
    #: The validated request and the registered model's row it runs.
    submission: Submission
    model_row: dict[str, Any]
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    plan: ExecutionPlan | None = None
    nodes: set[str] = field(default_factory=set)
    primary: str = ""
    phase: Literal["setup", "execution"] = "setup"
    worker_futures: dict[str, asyncio.Future[SetupOutcome]] = field(default_factory=dict)
    setup_future: asyncio.Future[SetupOutcome] | None = None
    #: Its prompt's prefix chain (PrefixRouter.chain), hashed once: placements and the
    #: admission queue route by it.
    prefix: tuple[int, ...] = ()
    #: The primary was told to run the job while its dispatch was being recorded (a warm
    #: one-node plan): the setup only waits for its answer.
    assigned_early: bool = False
    #: A placement of this job lost a slot to another controller: it is recorded before its
    #: primary is told, from then on.
    raced: bool = False
    #: Set once JOB_SETUP_VALIDATED is recorded; tokens may arrive (and be relayed) before.
    validated: asyncio.Event = field(default_factory=asyncio.Event)
    held: list[Delta] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    #: When generation started (the primary validated); None while queued or in setup.
    executing_since: float | None = None
    last_token_at: float | None = None
    #: The sequence number of the next delta: a re-sent delta below it is dropped.
    next_seq: int = 0
    #: The job exists in the store (JOB_SUBMITTED recorded).
    recorded: bool = False
    ticket: Ticket | None = None
    #: Nodes whose SECURITY_VIOLATION was recorded for this job (once per job and node).
    reported_violations: set[str] = field(default_factory=set)
    #: Nodes blamed for a failed setup of this job; later plans leave them out.
    excluded: set[str] = field(default_factory=set)
    #: The nodes of this job's earlier plans (their late messages are dropped quietly).
    past_nodes: set[str] = field(default_factory=set)

    @property
    def uid(self) -> UUID:
        return UUID(self.job_id)

    @property
    def model(self) -> str:
        return str(self.model_row["name"])

    @property
    def setup_ok(self) -> bool:
        """The primary reported a validated setup (JOB_SETUP_VALIDATED may be pending)."""
        future = self.setup_future
        return future is not None and future.done() and future.result().ok
