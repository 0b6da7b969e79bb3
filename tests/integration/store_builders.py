"""Helpers to drive the controller application in integration tests."""

from __future__ import annotations

from uuid import UUID

from application.commands import ChatPrompt, Delta, JobOutcome, JobParams, Submission
from application.controller import Controller
from tests.enrollments import ready_node
from tests.plans import one_node_plan


def enroll_ready(app: Controller, name: str = "n1", ram: int = 8 << 30) -> UUID:
    """A READY node of agent version 0.1.0 in rack ``a``."""
    return UUID(ready_node(app, name, ram=ram, agent_version="0.1.0", labels={"rack": "a"}))


def submit_job(app: Controller) -> UUID:
    """Submits one streamed "hi" for ``smollm2`` (8 tokens at most); its job's id."""
    job = app.submit(
        Submission(
            "smollm2",
            ChatPrompt([{"role": "user", "content": "hi"}]),
            JobParams(max_tokens=8),
            True,
        )
    )
    assert job.aggregate_id is not None
    return job.aggregate_id


def run_job(app: Controller, node_id: UUID, text: str = "Hello there") -> UUID:
    """Submits, plans, dispatches and completes one job on ``node_id``."""
    job_id = submit_job(app)
    app.plan_and_dispatch(job_id, one_node_plan(node_id), {str(node_id): "primary"})
    app.validate_setup(job_id)
    words = text.split(" ")
    deltas = [Delta(i, (" " if i else "") + w) for i, w in enumerate(words)]
    app.record_token_chunks({job_id: deltas[:1]})
    app.record_token_chunks({job_id: deltas[1:]})
    app.complete(job_id, JobOutcome("stop", 5, len(words), 12.5, 40.0))
    return job_id
