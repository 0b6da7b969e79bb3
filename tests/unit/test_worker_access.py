"""Who may reach each node's RPC worker (issue 21, finding 4), controller side: every
``StartRpcWorker`` carries the exact set of primaries of this controller's jobs that use the
worker, with their node ids, and a worker hears the set left (``RpcWorkerPeers``) when a job
stops using it. Pure bookkeeping, then the real job manager on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest

from application.agent_messages import SetupOutcome, SetupReported, WorkerStatus
from application.job_run import NoCapacityError
from application.ports import AllowedPeer
from application.worker_access import WorkerAccess
from domain.placement import ExecutionPlan, PlanNode
from tests.unit.job_cluster import GUARD, Cluster, submission

MIB = 1 << 20


def _plan(primary: str, *workers: str) -> ExecutionPlan:
    nodes = [PlanNode(n, f"10.0.0.{i + 1}", 50052, 1) for i, n in enumerate((primary, *workers))]
    share = 1 / len(nodes)
    return ExecutionPlan(
        model_name="m",
        model_sha256="a" * 64,
        model_file_name="m.gguf",
        context_size=2048,
        required_bytes=1,
        primary=nodes[0],
        workers=tuple(nodes[1:]),
        tensor_split=tuple(share for _ in nodes),
    )


def test_the_set_is_the_primaries_of_the_jobs_using_the_worker_and_nothing_else() -> None:
    access = WorkerAccess()
    a, b = AllowedPeer("a", "10.0.0.1"), AllowedPeer("b", "10.0.0.1")
    access.use("job-a", _plan("a", "w"))
    assert access.allowed("w") == (a,)
    assert access.allowed("a") == (a,)  # the primary's own worker: itself
    # Another primary takes the worker while A's job still runs (a runtime changing hands).
    access.use("job-b", _plan("b", "w"))
    assert access.allowed("w") == (a, b)
    assert access.release("job-a") == {"w": (b,), "a": ()}
    assert access.release("job-a") == {}  # once
    assert access.release("job-b") == {"w": (), "b": ()}
    assert access.jobs() == set()


def test_a_second_job_of_the_same_primary_keeps_it_in_until_the_last_one_ends() -> None:
    access = WorkerAccess()
    access.use("one", _plan("p", "w"))
    access.use("two", _plan("p", "w"))
    assert access.release("one") == {}  # unchanged: nothing to tell the worker
    assert access.release("two") == {"w": (), "p": ()}


def test_a_job_moved_by_a_re_plan_leaves_its_old_workers() -> None:
    access = WorkerAccess()
    access.use("job", _plan("p", "w1"))
    access.use("job", _plan("p", "w2"))
    assert access.allowed("w1") == ()
    assert access.allowed("w2") == (AllowedPeer("p", "10.0.0.1"),)


def test_a_one_node_plan_uses_no_worker() -> None:
    access = WorkerAccess()
    access.use("job", _plan("p"))
    assert access.jobs() == set() and access.allowed("p") == ()


async def _start_workers(cluster: Cluster, count: int, ok: bool = True) -> None:
    """Answers the RPC worker starts as they come, until ``count`` were answered."""
    answered = 0
    while answered < count:
        cluster.gateway.worker_asked.clear()
        for node, job in cluster.gateway.workers[answered:]:
            await cluster.jobs.handle(node, WorkerStatus(job, ok, "127.0.0.1", 50052, "boom"))
            answered += 1
        if answered < count:
            await asyncio.wait_for(cluster.gateway.worker_asked.wait(), GUARD)


async def test_workers_shared_by_two_jobs_hear_the_set_left_as_each_ends() -> None:
    # 100 MiB each: the model needs two nodes; the split server has two slots.
    cluster = Cluster(nodes=1, slots=2, ram=100 * MIB)
    primary = cluster.node_ids[0]
    worker = cluster.add_node("worker", holds_model=False)
    tasks = [
        asyncio.create_task(cluster.jobs.start(submission(f"q{i}"), cluster.model))
        for i in range(2)
    ]
    await _start_workers(cluster, 4)  # each job starts the RPC workers of both nodes
    await cluster.primary_assigned(2)
    for node, assignment in cluster.gateway.primaries:
        await cluster.validate(node, assignment.job_id)
    await asyncio.gather(*tasks)
    address = cluster.app.get_node(primary).address
    expected = (AllowedPeer(primary, address),)
    assert {allowed for _, allowed in cluster.gateway.worker_sets} == {expected}
    assert {node for node, _ in cluster.gateway.worker_sets} == {primary, worker}

    first, second = (a.job_id for _, a in cluster.gateway.primaries)
    await cluster.finish(primary, first)
    assert cluster.gateway.peer_updates == []  # the other job still uses both workers
    await cluster.finish(primary, second)
    assert sorted(cluster.gateway.peer_updates) == sorted([(primary, ()), (worker, ())])


async def test_a_setup_that_fails_leaves_no_worker_open_to_its_primary() -> None:
    cluster = Cluster(nodes=1, slots=1, ram=100 * MIB)
    primary = cluster.node_ids[0]
    worker = cluster.add_node("worker", holds_model=False)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    await _start_workers(cluster, 2)
    [(node, job_id)] = await cluster.primary_assigned(1)
    failed = SetupOutcome(ok=False, error="no file", error_code="MODEL_NOT_FOUND")
    await cluster.jobs.handle(node, SetupReported(job_id, failed))
    with pytest.raises(NoCapacityError):
        await task
    assert {n for n, _ in cluster.gateway.worker_sets} == {primary, worker}
    assert sorted(cluster.gateway.peer_updates) == sorted([(primary, ()), (worker, ())])
    assert cluster.jobs.worker_access.jobs() == set()
