"""A write the store took whose answer was lost (the database stopping just after the commit):
eventsourcing tries the insert again, finds the version taken, and the command runs again on
what is stored. Finding its own events there is the write having succeeded, not a refusal.
On the fake cluster: the in-memory store commits, then answers once with the conflict the
retry would meet; no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from uuid import uuid4

from eventsourcing.persistence import RecordConflictError

from application.agent_messages import TokensGenerated
from application.commands import Delta
from tests.unit.job_cluster import GUARD, MODEL, Cluster, submission


class LostAnswer:
    """Wraps ``command`` of the cluster's controller: while it runs, the first save commits
    and then raises the conflict its retry would meet."""

    def __init__(self, cluster: Cluster, command: str) -> None:
        self.lost = False
        self._armed = False
        real_save = cluster.app.save
        real_command: Callable[..., Any] = getattr(cluster.app, command)

        def save(*aggregates: Any, **kwargs: Any) -> Any:
            recordings = real_save(*aggregates, **kwargs)
            if self._armed and not self.lost:
                self.lost = True
                raise RecordConflictError("the version is taken (the first try committed)")
            return recordings

        def armed(*args: Any, **kwargs: Any) -> Any:
            self._armed = True
            try:
                return real_command(*args, **kwargs)
            finally:
                self._armed = False

        cluster.app.save = save  # type: ignore[method-assign]
        setattr(cluster.app, command, armed)


async def test_a_validation_whose_answer_was_lost_streams_on() -> None:
    """Run again, the command found the job validated and was refused: the client had its
    tokens, then waited the setup timeout (120 s) for the ending, which waits for the
    validation, and the tokens were never recorded."""
    cluster = Cluster(nodes=1)
    lost = LostAnswer(cluster, "validate_setup")
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)
    await asyncio.wait_for(run.validated.wait(), GUARD)
    assert lost.lost
    assert cluster.job_codes(job).count("JOB_SETUP_VALIDATED") == 1
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "Hi")]))
    await cluster.finish(node, job)
    assert cluster.job_codes(job)[-1] == "JOB_COMPLETED"
    assert cluster.gateway.cancels == []


async def test_a_dispatch_whose_answer_was_lost_runs_the_job() -> None:
    """Run again, the new jobs' command found their ids taken at every try and gave up
    (ConcurrencyExhausted): the client heard an error while the job stayed DISPATCHED in the
    store, holding its slot, until reconciliation ended it 30 s later."""
    cluster = Cluster(nodes=1)
    lost = LostAnswer(cluster, "record_new_jobs")
    job_id = uuid4()
    task = asyncio.create_task(cluster.jobs.start(submission(), MODEL, job_id))
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)
    assert lost.lost and job == str(job_id) and run.primary == node
    await cluster.finish(node, job)
    codes = cluster.job_codes(job)
    assert codes.count("JOB_SUBMITTED") == codes.count("JOB_DISPATCHED") == 1
    assert codes[-1] == "JOB_COMPLETED"
    assert cluster.gateway.cancels == []
    assert cluster.app.get_node(node).jobs == []
