"""New jobs placed at once are written together; a refused one alone fails (in-memory store)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest

from application.dispatch_batcher import DispatchBatcher
from application.errors import NotFound
from domain.errors import SlotTaken
from tests.plans import one_node_plan
from tests.unit.job_cluster import GUARD, Cluster, count, submission


async def test_a_burst_of_new_jobs_is_written_in_few_transactions() -> None:
    cluster = Cluster(nodes=10)
    batcher = cluster.jobs.dispatches
    release = threading.Event()
    real = cluster.app.record_new_jobs
    writing: list[Any] = []  # what the held first write took

    def held(dispatches: Any) -> int:
        writing.extend(dispatches)
        release.wait(GUARD)  # the first write is slow: the others queue up behind it
        return real(dispatches)

    cluster.app.record_new_jobs = held  # type: ignore[method-assign,assignment]
    tasks = [
        asyncio.create_task(cluster.jobs.start(submission(f"q{i}"), cluster.model))
        for i in range(10)
    ]

    async def the_rest_waiting() -> None:
        # The first write took one job, or more when placements ran in a thread meanwhile
        # (a slow machine): every other one waits behind it.
        while not writing or len(writing) + len(batcher._pending) < 10:
            await asyncio.sleep(0)  # yield to the placements (no clock involved)

    await asyncio.wait_for(the_rest_waiting(), GUARD)
    release.set()
    assignments = await cluster.primary_assigned(10)
    for node, job in assignments:
        await cluster.validate(node, job)
    await asyncio.wait_for(asyncio.gather(*tasks), GUARD)
    assert count(cluster, "JOB_DISPATCHED") == 10
    assert len({node for node, _ in assignments}) == 10
    # The first write takes the jobs placed before it began (placements are quick and run on
    # the event loop: maybe all ten), then one more takes those that waited behind it.
    assert batcher.transactions <= 2


async def test_a_job_whose_slot_is_taken_fails_alone_and_the_rest_are_written() -> None:
    cluster = Cluster(nodes=2)
    a, b = cluster.node_ids
    batcher = DispatchBatcher(cluster.app)
    jobs = [uuid.uuid4() for _ in range(3)]
    targets = [a, a, b]  # the second cannot have a's only slot
    results = await asyncio.wait_for(
        asyncio.gather(
            *(
                batcher.submit_and_dispatch(
                    submission(), job, one_node_plan(node), {node: "primary"}
                )
                for job, node in zip(jobs, targets, strict=True)
            ),
            return_exceptions=True,
        ),
        GUARD,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], SlotTaken)
    assert cluster.app.get_node(a).jobs == [str(jobs[0])]
    assert cluster.app.get_node(b).jobs == [str(jobs[2])]
    with pytest.raises(NotFound):
        cluster.app.get_job(jobs[1])  # nothing was written for it
