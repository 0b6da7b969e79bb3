"""JOB_SETUP_VALIDATED is written off the first token's path, and a failure to write it ends
the job cleanly (fake agent gateway, in-memory store; no sleeps)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from application.agent_messages import TokensGenerated
from application.commands import Delta
from application.store_guard import STORE_UNAVAILABLE, StoreUnavailable
from domain.errors import IllegalTransition
from tests.unit.job_cluster import GUARD, Cluster, submission


async def test_tokens_stream_before_the_validation_is_recorded_and_are_recorded_after() -> None:
    cluster = Cluster(nodes=1)
    release = asyncio.Event()
    real = cluster.app.validate_setup
    loop = asyncio.get_running_loop()

    def slow_validate(job_id: Any) -> int:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(GUARD)
        return real(job_id)

    cluster.app.validate_setup = slow_validate  # type: ignore[method-assign]
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)  # returned while the write still waits
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "Hi")]))
    item = await asyncio.wait_for(run.queue.get(), GUARD)
    assert item.kind == "deltas" and not run.validated.is_set()
    assert "JOB_SETUP_VALIDATED" not in cluster.job_codes(job)
    release.set()
    await asyncio.wait_for(run.validated.wait(), GUARD)
    await cluster.finish(node, job)
    codes = cluster.job_codes(job)
    assert codes.index("JOB_SETUP_VALIDATED") < codes.index("TOKEN_STREAM_CHUNK")
    assert codes[-1] == "JOB_COMPLETED"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        # The store went away: the client may retry (503 with Retry-After).
        (ConnectionError("the database went away"), STORE_UNAVAILABLE),
        (StoreUnavailable("the event store is unreachable"), STORE_UNAVAILABLE),
        # Anything else: a failure of the job (502).
        (RuntimeError("a bug"), "store_error"),
        # Refused by the job itself while no ending raced with it: a bug, not a hang.
        (IllegalTransition("job", "validate setup", "QUEUED"), "store_error"),
    ],
)
async def test_a_store_error_recording_the_validation_ends_the_job(
    error: Exception, code: str
) -> None:
    cluster = Cluster(nodes=1)

    def broken(job_id: Any) -> int:
        raise error

    cluster.app.validate_setup = broken  # type: ignore[method-assign]
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)
    item = await asyncio.wait_for(run.queue.get(), GUARD)
    assert item.kind == "error" and item.error_code == code
    assert cluster.gateway.cancels == [(node, job)]
    await cluster.until(lambda: cluster.job_codes(job)[-1] == "JOB_FAILED")
    assert cluster.app.get_node(node).jobs == []  # its slot is free again
