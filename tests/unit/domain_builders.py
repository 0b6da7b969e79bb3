"""Builders for domain tests: fresh aggregates in a given state."""

from __future__ import annotations

import uuid
from typing import Any

from domain.job import Job
from domain.node import Node


def new_node(slots: int = 1, name: str = "n1", credential_sha256: str = "c" * 64) -> Node:
    """A node just enrolled (REGISTERING) whose credential hashes to ``credential_sha256``."""
    return Node.enroll(
        node_id=uuid.uuid4(),
        name=name,
        inventory={"ram_free_bytes": 1000},
        agent_version="0.1.0",
        address="10.0.0.5",
        rpc_port=50052,
        labels={},
        credential_sha256=credential_sha256,
        token_id="tok",
        slots=slots,
    )


def ready_node(slots: int = 1) -> Node:
    node = new_node(slots)
    node.become_ready()
    return node


def new_job() -> Job:
    return Job.submit(
        job_id=uuid.uuid4(),
        model="smollm2",
        params={"max_tokens": 8},
        messages=[{"role": "user", "content": "hi"}],
        prompt_sha256="p" * 64,
        message_count=1,
        stream=True,
    )


def job_in(state: str) -> Job:
    job = new_job()
    steps: list[Any] = [
        ("PLANNED", lambda: job.record_plan({"primary": "n"})),
        ("DISPATCHED", lambda: job.dispatch(["n"])),
        ("SETUP_VALIDATED", lambda: job.validate_setup()),
        ("RUNNING", lambda: job.record_chunk([{"seq": 0, "text": "a", "tokens": 1}])),
    ]
    if state == "SUBMITTED":
        return job
    if state == "QUEUED":
        job.enqueue(1, "every slot is taken")
        return job
    for name, step in steps:
        step()
        if name == state:
            return job
    raise ValueError(state)


#: A job's events when it ran with two chunks of tokens and completed.
TWO_CHUNK_JOB_CODES = [
    "JOB_SUBMITTED",
    "JOB_PLANNED",
    "JOB_DISPATCHED",
    "JOB_SETUP_VALIDATED",
    "TOKEN_STREAM_CHUNK",
    "TOKEN_STREAM_CHUNK",
    "JOB_COMPLETED",
]


def complete(job: Job, prompt_tokens: int = 1, completion_tokens: int = 1) -> None:
    """Completes ``job`` with a stop (1 ms to the first token, 1 token a second)."""
    job.complete(
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        time_to_first_token_ms=1.0,
        tokens_per_second=1.0,
    )


def replay(aggregate_events: list[Any]) -> Any:
    """Rebuilds an aggregate from its events, as the repository would."""
    aggregate = None
    for event in aggregate_events:
        aggregate = event.mutate(aggregate)
    return aggregate
