"""The job manager's admission: queue, race-free placement, cancellation while queued.

JobManager and Scheduler run for real on an in-memory event store (eventsourcing's POPO
recorder), a read model that projects the store on every query, and a fake agent gateway. No
sleeps and no wall-clock windows: the tests wait for recorded events and gateway calls, with a
timeout only as a guard against hanging.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest

from application.admission import QueueFullError, QueueTimeoutError
from application.commands import ChatPrompt, Submission
from application.job_run import JobRun, NoCapacityError
from domain.catalog import code_of
from tests.plans import one_node_plan
from tests.unit.job_cluster import (
    GUARD,
    MODEL,
    Cluster,
    count,
    queued_count_is,
    submission,
)


async def busy_then_queued(
    cluster: Cluster, first_text: str, second_text: str
) -> tuple[asyncio.Task[JobRun], str, str, asyncio.Task[JobRun]]:
    """A first job takes the one slot (assigned, not yet validated), a second queues behind
    it: the first's task, node and job id, and the second's task."""
    first = asyncio.create_task(cluster.jobs.start(submission(first_text), MODEL))
    [(node, job_one)] = await cluster.primary_assigned(1)
    second = asyncio.create_task(cluster.jobs.start(submission(second_text), MODEL))
    await cluster.until(lambda: count(cluster, "JOB_QUEUED") == 1)
    return first, node, job_one, second


async def test_a_request_waits_for_a_busy_slot_instead_of_being_refused() -> None:
    cluster = Cluster(nodes=1)
    first, node, job_one, second = await busy_then_queued(cluster, "one", "two")
    await cluster.validate(node, job_one)
    await first
    assert not second.done()

    await cluster.finish(node, job_one)
    [_, (node_two, job_two)] = await cluster.primary_assigned(2)
    assert node_two == node
    await cluster.validate(node, job_two)
    await second
    assert cluster.job_codes(job_two)[:4] == [
        "JOB_SUBMITTED",
        "JOB_QUEUED",
        "JOB_PLANNED",
        "JOB_DISPATCHED",
    ]
    queued = next(e for e in cluster._events(job_two) if code_of(e) == "JOB_QUEUED")
    assert queued.position == 1
    assert count(cluster, "JOB_REPLANNED") == 0


async def test_queued_jobs_are_dispatched_in_queue_order() -> None:
    cluster = Cluster(nodes=1)
    blocker = asyncio.create_task(cluster.jobs.start(submission("first"), MODEL))
    [(node, running)] = await cluster.primary_assigned(1)
    waiting = []
    for i in range(4):
        waiting.append(asyncio.create_task(cluster.jobs.start(submission(f"w{i}"), MODEL)))
        await cluster.until(functools.partial(queued_count_is, cluster, i + 1))
    await cluster.validate(node, running)
    await blocker
    for i in range(4):
        await cluster.finish(node, running)
        assigned = await cluster.primary_assigned(i + 2)
        running = assigned[-1][1]
        await cluster.validate(node, running)
    await asyncio.gather(*waiting)
    queued_order = [job for code, job in cluster.all_codes() if code == "JOB_QUEUED"]
    dispatch_order = [job for code, job in cluster.all_codes() if code == "JOB_DISPATCHED"]
    assert dispatch_order[1:] == queued_order
    positions = [
        e.position
        for job in queued_order
        for e in cluster._events(job)
        if code_of(e) == "JOB_QUEUED"
    ]
    assert positions == [1, 2, 3, 4]


async def test_a_full_queue_refuses_at_once_and_records_nothing() -> None:
    cluster = Cluster(nodes=1, queue_max=1)
    runs = asyncio.create_task(cluster.jobs.start(submission("runs"), MODEL))
    await cluster.primary_assigned(1)
    waits = asyncio.create_task(cluster.jobs.start(submission("waits"), MODEL))
    await cluster.until(lambda: count(cluster, "JOB_QUEUED") == 1)
    before = len(cluster.all_codes())
    with pytest.raises(QueueFullError) as refused:
        await cluster.jobs.start(submission("refused"), MODEL)
    assert refused.value.code == "queue_full" and refused.value.retry_after > 0
    assert len(cluster.all_codes()) == before
    runs.cancel()
    waits.cancel()


async def test_a_queue_timeout_fails_the_job_and_frees_its_place() -> None:
    cluster = Cluster(nodes=1, queue_timeout=0.0)
    runs = asyncio.create_task(cluster.jobs.start(submission("runs"), MODEL))
    await cluster.primary_assigned(1)
    with pytest.raises(QueueTimeoutError) as timed_out:
        await cluster.jobs.start(submission("too late"), MODEL)
    assert timed_out.value.code == "queue_timeout"
    failed = [job for code, job in cluster.all_codes() if code == "JOB_FAILED"]
    assert len(failed) == 1
    assert cluster.job_codes(failed[0]) == ["JOB_SUBMITTED", "JOB_QUEUED", "JOB_FAILED"]
    row = cluster.read.get_job(failed[0])
    assert row is not None and row["error_code"] == "queue_timeout"
    assert len(cluster.jobs.queue) == 0
    runs.cancel()


async def test_a_client_that_leaves_while_queued_cancels_without_taking_a_slot() -> None:
    cluster = Cluster(nodes=1)
    first, node, job_one, leaver = await busy_then_queued(cluster, "runs", "leaves")
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    cancelled = [job for code, job in cluster.all_codes() if code == "JOB_CANCELLED"]
    assert len(cancelled) == 1
    assert cluster.job_codes(cancelled[0]) == ["JOB_SUBMITTED", "JOB_QUEUED", "JOB_CANCELLED"]
    assert len(cluster.jobs.queue) == 0
    await cluster.validate(node, job_one)
    await first
    await cluster.finish(node, job_one)
    freed = cluster.read.get_node(node)
    assert freed is not None and freed["current_jobs"] == []  # nobody took the freed slot


async def test_concurrent_placements_never_collide() -> None:
    cluster = Cluster(nodes=30)
    starts = [
        asyncio.create_task(cluster.jobs.start(submission(f"j{i}"), MODEL)) for i in range(30)
    ]
    assigned = await cluster.primary_assigned(30)
    assert len({node for node, _ in assigned}) == 30  # one job per single-slot node
    for node, job in assigned:
        await cluster.validate(node, job)
    await asyncio.gather(*starts)
    codes = [code for code, _ in cluster.all_codes()]
    assert codes.count("JOB_DISPATCHED") == 30
    assert "JOB_QUEUED" not in codes and "JOB_REPLANNED" not in codes and "JOB_FAILED" not in codes
    running = [n for n in cluster.read.list_nodes() if len(n["current_jobs"]) == 1]
    assert len(running) == 30


def stale_view_with_a_rival_job(cluster: Cluster) -> tuple[str, Callable[[], None]]:
    """Another controller dispatches a job to the first node; this one's read model goes stale
    and has not seen it. Returns that node and the view's real catch-up."""
    cluster.read.catch_up()
    real_catch_up = cluster.read.catch_up
    cluster.read.catch_up = lambda: None  # type: ignore[method-assign]
    target = min(cluster.node_ids)
    rival = cluster.app.submit(submission("rival"))
    assert rival.aggregate_id is not None
    cluster.app.plan_and_dispatch(rival.aggregate_id, one_node_plan(target), {target: "primary"})
    return target, real_catch_up


async def test_a_slot_taken_by_another_controller_costs_a_fresh_placement_not_a_replan() -> None:
    cluster = Cluster(nodes=2)
    target, real_catch_up = stale_view_with_a_rival_job(cluster)
    caught_up = []

    def catch_up() -> None:  # what the job manager asks for after losing a slot
        cluster.read.catch_up = real_catch_up  # type: ignore[method-assign]
        real_catch_up()
        caught_up.append(True)

    cluster.scheduler_hook = catch_up
    task = asyncio.create_task(cluster.jobs.start(submission("mine"), MODEL))
    [(node, job)] = await cluster.primary_assigned(1)
    assert node != target and caught_up == [True]
    await cluster.validate(node, job)
    await task
    codes = cluster.job_codes(job)
    assert codes[:3] == ["JOB_SUBMITTED", "JOB_PLANNED", "JOB_DISPATCHED"]
    assert "JOB_REPLANNED" not in codes and "JOB_QUEUED" not in codes


async def test_views_too_far_behind_to_catch_up_do_not_fail_the_request() -> None:
    cluster = Cluster(nodes=2)
    target, real_catch_up = stale_view_with_a_rival_job(cluster)

    def catch_up() -> None:  # the wait for the views times out; they catch up later
        cluster.read.catch_up = real_catch_up  # type: ignore[method-assign]
        raise TimeoutError("read model at position 1 did not reach 2 within 5.0 s")

    cluster.scheduler_hook = catch_up
    task = asyncio.create_task(cluster.jobs.start(submission("mine"), MODEL))
    [(node, job)] = await cluster.primary_assigned(1)
    assert node != target
    await cluster.validate(node, job)
    await task
    assert "JOB_FAILED" not in cluster.job_codes(job)


async def test_no_node_can_ever_hold_the_model_fails_fast_without_queueing() -> None:
    cluster = Cluster(nodes=1)
    ghost = {**MODEL, "name": "ghost", "sha256": "f" * 64}
    with pytest.raises(NoCapacityError):
        await cluster.jobs.start(
            Submission("ghost", ChatPrompt([{"role": "user", "content": "x"}])), ghost
        )
    codes = [code for code, _ in cluster.all_codes()]
    assert "JOB_QUEUED" not in codes
    assert codes[-2:] == ["JOB_SUBMITTED", "JOB_FAILED"]


async def test_only_nodes_connected_to_this_controller_are_placed_on() -> None:
    cluster = Cluster(nodes=2)
    cluster.gateway.disconnected.add(cluster.node_ids[0])
    task = asyncio.create_task(cluster.jobs.start(submission(), MODEL))
    [(node, job)] = await cluster.primary_assigned(1)
    assert node == cluster.node_ids[1]
    await cluster.validate(node, job)
    await task


async def held_write(cluster: Cluster, name: str) -> tuple[asyncio.Event, threading.Event]:
    """Makes ``cluster.app.<name>`` wait in its thread until released; returns (started,
    release)."""
    started, release = asyncio.Event(), threading.Event()
    real = getattr(cluster.app, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        cluster.loop.call_soon_threadsafe(started.set)
        release.wait(GUARD)
        return real(*args, **kwargs)

    setattr(cluster.app, name, held)
    return started, release


@pytest.mark.parametrize("write", ["queued", "dispatched"])
async def test_a_client_that_leaves_during_the_write_that_creates_its_job_ends_it(
    write: str,
) -> None:
    cluster = Cluster(nodes=1)
    if write == "queued":  # the only slot is busy, so the next job queues
        asyncio.create_task(cluster.jobs.start(submission("runs"), MODEL))  # noqa: RUF006
        await cluster.primary_assigned(1)
    started, release = await held_write(cluster, "record_new_jobs")
    leaver = asyncio.create_task(cluster.jobs.start(submission("leaves"), MODEL))
    await asyncio.wait_for(started.wait(), GUARD)
    leaver.cancel()
    release.set()  # the write completes after the client has gone
    with pytest.raises(asyncio.CancelledError):
        await leaver
    cancelled = [job for code, job in cluster.all_codes() if code == "JOB_CANCELLED"]
    assert len(cancelled) == 1
    codes = cluster.job_codes(cancelled[0])
    assert codes[0] == "JOB_SUBMITTED" and codes[-1] == "JOB_CANCELLED"
    if write == "dispatched":
        node = cluster.read.get_node(cluster.node_ids[0])
        assert node is not None and node["current_jobs"] == []  # its slot was given back
