"""The job manager ends jobs past their deadlines (fake agent gateway, in-memory store; the
deadline check is given its time, so there are no sleeps)."""

from __future__ import annotations

import asyncio
import time

from application.agent_messages import TokensGenerated
from application.commands import Delta
from application.deadlines import FIRST_TOKEN_TIMEOUT, STREAM_IDLE_TIMEOUT, Deadlines
from tests.unit.job_cluster import GUARD, Cluster


async def test_a_job_without_a_first_token_is_ended_and_its_slot_freed() -> None:
    cluster = Cluster(nodes=1)
    cluster.jobs.deadlines = Deadlines(first_token=30.0, stream_idle=5.0)
    node, job, run = await cluster.running_job()
    assert cluster.jobs.enforce_deadlines(time.monotonic() + 29.0) == []
    assert cluster.jobs.enforce_deadlines(time.monotonic() + 31.0) == [job]
    item = await asyncio.wait_for(run.queue.get(), GUARD)
    assert (item.kind, item.error_code) == ("error", FIRST_TOKEN_TIMEOUT)
    assert (node, job) in cluster.gateway.cancels
    await cluster.jobs.settle()
    assert cluster.job_codes(job)[-1] == "JOB_FAILED"
    assert cluster.app.get_node(node).jobs == []
    # A late token or result from the primary is dropped: the job has ended.
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "late")]))
    await cluster.finish(node, job)
    assert cluster.job_codes(job)[-1] == "JOB_FAILED"


async def test_a_stream_that_keeps_producing_is_not_ended_an_idle_one_is() -> None:
    cluster = Cluster(nodes=1)
    cluster.jobs.deadlines = Deadlines(first_token=30.0, stream_idle=5.0)
    node, job, run = await cluster.running_job()
    for seq in range(3):
        await cluster.jobs.handle(node, TokensGenerated(job, [Delta(seq, "w")]))
        assert cluster.jobs.enforce_deadlines(time.monotonic() + 4.0) == []
    assert cluster.jobs.enforce_deadlines(time.monotonic() + 6.0) == [job]
    kinds = []
    while True:
        item = await asyncio.wait_for(run.queue.get(), GUARD)
        kinds.append(item.kind)
        if item.kind == "error":
            assert item.error_code == STREAM_IDLE_TIMEOUT
            break
    assert kinds == ["deltas", "deltas", "deltas", "error"]
    await cluster.jobs.settle()
    codes = cluster.job_codes(job)
    assert codes[-1] == "JOB_FAILED" and "TOKEN_STREAM_CHUNK" in codes
