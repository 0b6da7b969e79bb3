"""Builders for domain tests: fresh aggregates in a given state."""

from __future__ import annotations

import uuid
from typing import Any

from domain.job import Job
from domain.node import Node


def new_node(slots: int = 1, name: str = "n1") -> Node:
    return Node.enroll(
        node_id=uuid.uuid4(),
        name=name,
        inventory={"ram_free_bytes": 1000},
        agent_version="0.1.0",
        address="10.0.0.5",
        rpc_port=50052,
        labels={},
        credential_sha256="c" * 64,
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


def replay(aggregate_events: list[Any]) -> Any:
    """Rebuilds an aggregate from its events, as the repository would."""
    aggregate = None
    for event in aggregate_events:
        aggregate = event.mutate(aggregate)
    return aggregate
