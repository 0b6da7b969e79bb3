"""Node and job states as string enums, so they serialise as plain strings.

See docs/lifecycles.md, 'Node state machine' and 'Job lifecycle'.
"""

from __future__ import annotations

from enum import StrEnum


class NodeState(StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"
    BUSY = "BUSY"
    DRAINING = "DRAINING"
    DEGRADED = "DEGRADED"
    OFFLINE = "OFFLINE"
    ERROR = "ERROR"


class JobState(StrEnum):
    SUBMITTED = "SUBMITTED"
    QUEUED = "QUEUED"
    PLANNED = "PLANNED"
    DISPATCHED = "DISPATCHED"
    SETUP_VALIDATED = "SETUP_VALIDATED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    #: The client's request was refused as invalid (a prompt over the context, a request
    #: llama-server refused): the client's error, never counted against a node.
    REJECTED = "REJECTED"


TERMINAL_JOB_STATES = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.REJECTED}
)
SETUP_PHASE_STATES = frozenset(
    {JobState.SUBMITTED, JobState.QUEUED, JobState.PLANNED, JobState.DISPATCHED}
)
EXECUTION_PHASE_STATES = frozenset({JobState.SETUP_VALIDATED, JobState.RUNNING})
#: Every state of a job that has not ended (what a controller restart must account for).
UNFINISHED_JOB_STATES = SETUP_PHASE_STATES | EXECUTION_PHASE_STATES


class FailurePhase(StrEnum):
    SETUP = "setup"
    EXECUTION = "execution"
