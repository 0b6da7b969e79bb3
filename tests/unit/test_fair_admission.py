"""The job manager queues requests in the fair order (application/admission.py): each request's
Grant decides its turn, JOB_QUEUED records its position in that order, and the one slot goes
to the keys in turn. On the in-memory cluster of tests/unit/job_cluster.py, no sleeps."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

from application.job_run import JobRun
from domain.api_keys import Grant
from domain.catalog import code_of
from tests.unit.job_cluster import MODEL, Cluster, queued_count_is, submission

A = Grant("a", "team a")
B = Grant("b", "team b")


async def test_two_keys_take_turns_for_one_slot_and_positions_follow_the_order() -> None:
    cluster = Cluster(nodes=1)
    blocker = asyncio.create_task(cluster.jobs.start(submission("first"), MODEL))
    [(node, running)] = await cluster.primary_assigned(1)
    waiting: list[asyncio.Task[JobRun]] = []
    arrivals = [("a1", A), ("a2", A), ("a3", A), ("b1", B), ("b2", B)]
    for i, (text, grant) in enumerate(arrivals):
        asked = replace(submission(text), grant=grant)
        waiting.append(asyncio.create_task(cluster.jobs.start(asked, MODEL)))
        await cluster.until(functools.partial(queued_count_is, cluster, i + 1))
    await cluster.validate(node, running)
    await blocker
    for i in range(len(arrivals)):
        await cluster.finish(node, running)
        running = (await cluster.primary_assigned(i + 2))[-1][1]
        await cluster.validate(node, running)
    await asyncio.gather(*waiting)
    queued = [job for code, job in cluster.all_codes() if code == "JOB_QUEUED"]
    texts = dict(zip(queued, [text for text, _ in arrivals], strict=True))
    dispatched = [job for code, job in cluster.all_codes() if code == "JOB_DISPATCHED"]
    assert [texts[job] for job in dispatched[1:]] == ["a1", "b1", "a2", "b2", "a3"]
    positions = [
        e.position for job in queued for e in cluster._events(job) if code_of(e) == "JOB_QUEUED"
    ]
    # as the queue stood at each arrival: b1 goes second, b2 fourth
    assert positions == [1, 2, 3, 2, 4]
