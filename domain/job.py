"""The Job aggregate: one chat completion through its three phases (docs/lifecycles.md,
'Job lifecycle').

submitted [→ queued] → planned → dispatched → setup validated → running → completed | failed |
cancelled. A job waits in the admission queue (queued) when no plan can start at once.
A job is re-planned only before execution; a failure records whether it happened during
setup or execution, derived from the state it was in, so the two can never disagree.
"""

from __future__ import annotations

from typing import Any, ClassVar

from eventsourcing.domain import Aggregate

from domain.errors import IllegalTransition, InvalidCommand
from domain.states import (
    EXECUTION_PHASE_STATES,
    SETUP_PHASE_STATES,
    TERMINAL_JOB_STATES,
    FailurePhase,
    JobState,
)

#: How many times a job may be re-planned before it gives up (then HTTP 503).
MAX_REPLANS = 3


class Job(Aggregate):
    class Event(Aggregate.Event):
        """A job event; every kind of job event leads to exactly one state."""

        code: ClassVar[str] = ""
        resulting_state: ClassVar[JobState]

        def apply(self, aggregate: Any) -> None:
            job: Job = aggregate
            self.evolve(job)
            job.state = self.resulting_state

        def evolve(self, job: Job) -> None:
            """Changes the job's state; overridden by each event."""

    class Submitted(Aggregate.Created):
        code: ClassVar[str] = "JOB_SUBMITTED"
        resulting_state: ClassVar[JobState] = JobState.SUBMITTED
        model: str
        params: dict[str, Any]
        messages: list[dict[str, Any]] | None
        prompt_sha256: str
        message_count: int
        stream: bool
        #: The controller process that runs the job (absent in jobs recorded before).
        controller: str = ""
        #: The API key the job was asked with (``domain/api_keys.py``; absent before keys).
        key_id: str = ""

    class Queued(Event):
        """No plan could start at once; the job waits in its model's admission queue."""

        code: ClassVar[str] = "JOB_QUEUED"
        resulting_state: ClassVar[JobState] = JobState.QUEUED
        position: int
        reason: str

        def evolve(self, job: Job) -> None:
            job.queued_at = self.timestamp.isoformat()

    class Planned(Event):
        code: ClassVar[str] = "JOB_PLANNED"
        resulting_state: ClassVar[JobState] = JobState.PLANNED
        plan: dict[str, Any]

        def evolve(self, job: Job) -> None:
            job.plan = self.plan
            job.planned_at = self.timestamp.isoformat()

    class Replanned(Event):
        code: ClassVar[str] = "JOB_REPLANNED"
        resulting_state: ClassVar[JobState] = JobState.PLANNED
        plan: dict[str, Any]
        reason: str
        excluded_node: str
        #: The device whose out-of-memory caused the re-plan: ``node_id``, ``device`` (its name
        #: there), ``planned_bytes`` (what the failed plan gave it), ``asked_bytes``; None when
        #: the re-plan had another cause (and in events recorded before devices).
        out_of_memory: dict[str, Any] | None = None

        def evolve(self, job: Job) -> None:
            job.plan = self.plan
            job.replans += 1
            if self.excluded_node:
                job.excluded_nodes = sorted({*job.excluded_nodes, self.excluded_node})

    class Dispatched(Event):
        code: ClassVar[str] = "JOB_DISPATCHED"
        resulting_state: ClassVar[JobState] = JobState.DISPATCHED
        nodes: list[str]
        #: How the server was chosen (``application/prefix_routing.py``): ``{"prefix": "hit" |
        #: "miss", "matched_chars": n}``; None for jobs that are not routed by prefix
        #: (embeddings) and in events recorded before routing.
        route: dict[str, Any] | None = None

        def evolve(self, job: Job) -> None:
            job.nodes = list(self.nodes)
            job.dispatched_at = self.timestamp.isoformat()

    class SetupValidated(Event):
        code: ClassVar[str] = "JOB_SETUP_VALIDATED"
        resulting_state: ClassVar[JobState] = JobState.SETUP_VALIDATED

        def evolve(self, job: Job) -> None:
            job.validated_at = self.timestamp.isoformat()

    class TokenStreamChunk(Event):
        """A batch of deltas: ``[{"seq": n, "text": "…" | None, "sha256": "…", "tokens": k}]``."""

        code: ClassVar[str] = "TOKEN_STREAM_CHUNK"
        resulting_state: ClassVar[JobState] = JobState.RUNNING
        deltas: list[dict[str, Any]]
        token_count: int

        def evolve(self, job: Job) -> None:
            job.next_seq = int(self.deltas[-1]["seq"]) + 1
            job.tokens_streamed += self.token_count
            if job.first_token_at is None:
                job.first_token_at = self.timestamp.isoformat()

    class Completed(Event):
        code: ClassVar[str] = "JOB_COMPLETED"
        resulting_state: ClassVar[JobState] = JobState.COMPLETED
        finish_reason: str
        prompt_tokens: int
        completion_tokens: int
        time_to_first_token_ms: float
        tokens_per_second: float
        #: Of ``prompt_tokens``, those llama-server reused from its cache rather than evaluated
        #: again (its ``prompt_tokens_details.cached_tokens``); 0 when none, when not said, and in
        #: events recorded before it was.
        cached_prompt_tokens: int = 0

        def evolve(self, job: Job) -> None:
            job.finish_reason = self.finish_reason
            job.ended_at = self.timestamp.isoformat()

    class Failed(Event):
        code: ClassVar[str] = "JOB_FAILED"
        resulting_state: ClassVar[JobState] = JobState.FAILED
        phase: str
        reason: str
        error_code: str

        def evolve(self, job: Job) -> None:
            job.failure_phase = self.phase
            job.failure_reason = self.reason
            job.ended_at = self.timestamp.isoformat()

    class Rejected(Event):
        """The client's request was invalid (HTTP 400): the client's error, not a node's."""

        code: ClassVar[str] = "JOB_REJECTED"
        resulting_state: ClassVar[JobState] = JobState.REJECTED
        reason: str
        error_code: str

        def evolve(self, job: Job) -> None:
            job.failure_reason = self.reason
            job.ended_at = self.timestamp.isoformat()

    class Cancelled(Event):
        code: ClassVar[str] = "JOB_CANCELLED"
        resulting_state: ClassVar[JobState] = JobState.CANCELLED
        reason: str

        def evolve(self, job: Job) -> None:
            job.failure_reason = self.reason
            job.ended_at = self.timestamp.isoformat()

    def __init__(
        self,
        model: str,
        params: dict[str, Any],
        messages: list[dict[str, Any]] | None,
        prompt_sha256: str,
        message_count: int,
        stream: bool,
        controller: str = "",
        key_id: str = "",
    ) -> None:
        self.model = model
        self.controller = controller
        self.key_id = key_id
        self.params = params
        self.messages = messages
        self.prompt_sha256 = prompt_sha256
        self.message_count = message_count
        self.stream = stream
        self.state = JobState.SUBMITTED
        self.plan: dict[str, Any] | None = None
        self.replans = 0
        self.excluded_nodes: list[str] = []
        self.nodes: list[str] = []
        self.next_seq = 0
        self.tokens_streamed = 0
        self.queued_at: str | None = None
        self.planned_at: str | None = None
        self.dispatched_at: str | None = None
        self.validated_at: str | None = None
        self.first_token_at: str | None = None
        self.ended_at: str | None = None
        self.finish_reason: str | None = None
        self.failure_phase: str | None = None
        self.failure_reason: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    def _refuse(self, command: str, detail: str = "") -> IllegalTransition:
        return IllegalTransition("job", command, str(self.state), detail)

    @classmethod
    def submit(
        cls,
        *,
        job_id: Any,
        model: str,
        params: dict[str, Any],
        messages: list[dict[str, Any]] | None,
        prompt_sha256: str,
        message_count: int,
        stream: bool,
        controller: str = "",
        key_id: str = "",
    ) -> Job:
        if not model:
            raise InvalidCommand("a job needs a model")
        if message_count < 1:
            raise InvalidCommand("a job needs at least one message")
        return cls._create(
            cls.Submitted,
            id=job_id,
            model=model,
            params=params,
            messages=messages,
            prompt_sha256=prompt_sha256,
            message_count=message_count,
            stream=stream,
            controller=controller,
            key_id=key_id,
        )

    def enqueue(self, position: int, reason: str) -> None:
        if self.state != JobState.SUBMITTED:
            raise self._refuse("be queued", "only a submitted job is queued")
        if position < 1:
            raise InvalidCommand(f"a queue position starts at 1, got {position}")
        self.trigger_event(self.Queued, position=position, reason=reason)

    def record_plan(self, plan: dict[str, Any]) -> None:
        if self.state not in (JobState.SUBMITTED, JobState.QUEUED):
            raise self._refuse("be planned", "only a submitted or queued job is planned")
        self.trigger_event(self.Planned, plan=plan)

    def replan(
        self,
        plan: dict[str, Any],
        reason: str,
        excluded_node: str = "",
        out_of_memory: dict[str, Any] | None = None,
    ) -> None:
        if self.state not in (JobState.PLANNED, JobState.DISPATCHED):
            raise self._refuse("be re-planned", "re-planning happens only before execution")
        if self.replans >= MAX_REPLANS:
            raise self._refuse("be re-planned", f"it was already re-planned {self.replans} times")
        self.trigger_event(
            self.Replanned,
            plan=plan,
            reason=reason,
            excluded_node=excluded_node,
            out_of_memory=out_of_memory,
        )

    def dispatch(self, nodes: list[str], route: dict[str, Any] | None = None) -> None:
        if self.state != JobState.PLANNED:
            raise self._refuse("be dispatched", "only a planned job is dispatched")
        if not nodes:
            raise InvalidCommand("a dispatch needs at least one node")
        self.trigger_event(self.Dispatched, nodes=nodes, route=route)

    def validate_setup(self) -> None:
        if self.state != JobState.DISPATCHED:
            raise self._refuse("validate setup", "only a dispatched job is validated")
        self.trigger_event(self.SetupValidated)

    def record_chunk(self, deltas: list[dict[str, Any]]) -> None:
        if self.state not in EXECUTION_PHASE_STATES:
            raise self._refuse("stream tokens", "tokens flow only after setup is validated")
        if not deltas:
            raise InvalidCommand("a token chunk needs at least one delta")
        expected = self.next_seq
        for delta in deltas:
            if int(delta["seq"]) != expected:
                raise InvalidCommand(f"delta sequence {delta['seq']} where {expected} was due")
            expected += 1
        count = sum(int(d.get("tokens", 0)) for d in deltas)
        self.trigger_event(self.TokenStreamChunk, deltas=deltas, token_count=count)

    def complete(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        time_to_first_token_ms: float,
        tokens_per_second: float,
        cached_prompt_tokens: int = 0,
    ) -> None:
        if self.state not in EXECUTION_PHASE_STATES:
            raise self._refuse("complete", "only an executing job completes")
        self.trigger_event(
            self.Completed,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            time_to_first_token_ms=time_to_first_token_ms,
            tokens_per_second=tokens_per_second,
            cached_prompt_tokens=cached_prompt_tokens,
        )

    def fail(self, reason: str, error_code: str = "") -> FailurePhase:
        if self.terminal:
            raise self._refuse("fail", "it has already ended")
        phase = FailurePhase.SETUP if self.state in SETUP_PHASE_STATES else FailurePhase.EXECUTION
        self.trigger_event(self.Failed, phase=phase.value, reason=reason, error_code=error_code)
        return phase

    def reject(self, reason: str, error_code: str) -> None:
        """Ends the job as the client's error (its request was invalid)."""
        if self.terminal:
            raise self._refuse("be rejected", "it has already ended")
        self.trigger_event(self.Rejected, reason=reason, error_code=error_code)

    def cancel(self, reason: str) -> None:
        if self.terminal:
            raise self._refuse("be cancelled", "it has already ended")
        self.trigger_event(self.Cancelled, reason=reason)
