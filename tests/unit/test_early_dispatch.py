"""A warm one-node plan's primary is told to run the job while its dispatch is being recorded
(application/job_setup.py: JobSetup._dispatch_at_once), so the store's transaction is off the
first token's path; if the store refuses the dispatch, the primary is told to stop and the
store's error stands. Cold plans and splits are recorded first, as before. On the fake
cluster: the write is held or refused in its thread, no sleeps."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import pytest

from application.agent_messages import SetupOutcome, SetupReported, TokensGenerated
from application.commands import Delta
from domain.errors import SlotTaken
from tests.unit.job_cluster import GUARD, MODEL, Cluster, submission
from tests.unit.test_job_admission import held_write


async def warm_cluster() -> tuple[Cluster, str]:
    """One node whose server is warm: one job ran on it to its end."""
    cluster = Cluster(nodes=1, slots=2)
    node, job, _ = await cluster.running_job()
    await cluster.finish(node, job)
    return cluster, node


async def test_the_primary_of_a_warm_server_is_told_before_the_dispatch_is_stored() -> None:
    cluster, node = await warm_cluster()
    started, release = await held_write(cluster, "record_new_jobs")
    job_id = uuid4()
    task = asyncio.create_task(cluster.jobs.start(submission("warm"), MODEL, job_id))
    await asyncio.wait_for(started.wait(), GUARD)
    [(assigned_to, assignment)] = (await cluster.primary_assigned(2))[1:]
    assert (assigned_to, assignment) == (node, str(job_id))
    assert cluster.job_codes(str(job_id)) == []  # nothing stored yet: the write is held
    await cluster.validate(node, str(job_id))  # the primary answers meanwhile
    assert not task.done()  # the job starts only once its dispatch is stored
    release.set()
    run = await asyncio.wait_for(task, GUARD)
    assert run.primary == node
    await cluster.finish(node, str(job_id))
    codes = cluster.job_codes(str(job_id))
    assert codes[0] == "JOB_SUBMITTED" and codes[-1] == "JOB_COMPLETED"
    assert codes.index("JOB_DISPATCHED") < codes.index("JOB_SETUP_VALIDATED")


def dispatch_refused_once(cluster: Cluster, error: Exception) -> None:
    """The store refuses the next new jobs' write with ``error``, then takes them again."""
    real = cluster.app.record_new_jobs

    def refused(*args: Any, **kwargs: Any) -> Any:
        setattr(cluster.app, "record_new_jobs", real)  # noqa: B010  (once)
        raise error

    setattr(cluster.app, "record_new_jobs", refused)  # noqa: B010


async def test_a_dispatch_the_store_refuses_stops_the_primary_and_the_error_stands() -> None:
    cluster, node = await warm_cluster()
    dispatch_refused_once(cluster, RuntimeError("the store is down"))
    job_id = uuid4()
    with pytest.raises(RuntimeError, match="the store is down"):
        await cluster.jobs.start(submission("refused"), MODEL, job_id)
    assert cluster.gateway.primaries[-1][1].job_id == str(job_id)  # it was told
    assert (node, str(job_id)) in cluster.gateway.cancels  # and then told to stop
    assert cluster.job_codes(str(job_id)) == []
    # the slot is free again: the next job runs there
    before = len(cluster.gateway.primaries)
    task = asyncio.create_task(cluster.jobs.start(submission("next"), MODEL))
    [(again, job)] = (await cluster.primary_assigned(before + 1))[before:]
    await cluster.validate(again, job)
    await asyncio.wait_for(task, GUARD)
    assert again == node and cluster.job_codes(job)[0] == "JOB_SUBMITTED"


async def test_a_cold_plan_is_stored_before_its_primary_is_told() -> None:
    cluster = Cluster(nodes=1)
    started, release = await held_write(cluster, "record_new_jobs")
    task = asyncio.create_task(cluster.jobs.start(submission("cold"), MODEL))
    await asyncio.wait_for(started.wait(), GUARD)
    for _ in range(20):  # let everything that could run, run
        await asyncio.sleep(0)
    assert cluster.gateway.primaries == []
    release.set()
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    await asyncio.wait_for(task, GUARD)


async def test_a_job_whose_early_primary_lost_its_slot_goes_on_under_a_new_id() -> None:
    """The store refused the dispatch because the slot was gone (the node turned DEGRADED, or
    another controller took it) after the primary had been told: the primary is told to stop,
    and the job is placed again under a new id, so what the primary still sends about the
    first one is late, not the answer to the next plan. Under one id a fault test's agent,
    which stops answering for a job id once told to cancel it, left its client waiting."""
    cluster, node = await warm_cluster()
    dispatch_refused_once(cluster, SlotTaken("node cannot take a job while DEGRADED"))
    first = uuid4()
    task = asyncio.create_task(cluster.jobs.start(submission("raced"), MODEL, first))
    [(told, early), (again, job)] = (await cluster.primary_assigned(3))[1:]
    assert (told, early) == (node, str(first)) and (node, early) in cluster.gateway.cancels
    assert again == node and job != early
    # the first assignment's answers come late: dropped quietly, not refused
    assert await cluster.jobs.handle(node, SetupReported(early, SetupOutcome(ok=True))) is None
    assert await cluster.jobs.handle(node, TokensGenerated(early, [Delta(0, "x")])) is None
    await cluster.validate(node, job)
    run = await asyncio.wait_for(task, GUARD)
    assert run.job_id == job
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "Hi")]))
    assert (await asyncio.wait_for(run.queue.get(), GUARD)).deltas[0].text == "Hi"
    await cluster.finish(node, job)
    assert cluster.job_codes(job)[-1] == "JOB_COMPLETED"
    assert cluster.job_codes(early) == []  # nothing was ever recorded under the first id
