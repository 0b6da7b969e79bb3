"""Slots per running server and warm-model scheduling, through the real job manager and
scheduler on an in-memory store with a fake agent gateway (see ``job_cluster``).

Model sizes (``job_cluster``): 100 MiB of weights and 2 MiB of KV cache per 2,048-token slot,
so one slot needs ≈176.4 MiB with headroom and overhead, and each more slot ≈2.2 MiB.
"""

from __future__ import annotations

import asyncio
from typing import Any

from application.agent_messages import WorkerStatus
from domain.placement import ExecutionPlan
from tests.unit.job_cluster import GIB, GUARD, Cluster, count, submission

MIB = 1 << 20


def plan_of(cluster: Cluster, job_id: str) -> ExecutionPlan:
    job = cluster.app.get_job(job_id)
    assert job.plan is not None
    return ExecutionPlan.from_dict(job.plan)


async def start_jobs(cluster: Cluster, n: int, first: int = 0) -> list[asyncio.Task[Any]]:
    tasks = [
        asyncio.create_task(cluster.jobs.start(submission(f"q{i}"), cluster.model))
        for i in range(first, first + n)
    ]
    await cluster.primary_assigned(first + n)
    return tasks


async def validate_all(cluster: Cluster, tasks: list[asyncio.Task[Any]], first: int = 0) -> None:
    for node, assignment in cluster.gateway.primaries[first : first + len(tasks)]:
        await cluster.validate(node, assignment.job_id)
    await asyncio.gather(*tasks)


async def test_one_server_serves_its_slots_at_once_and_counts_them() -> None:
    cluster = Cluster(nodes=1, slots=4)
    tasks = await start_jobs(cluster, 4)
    await validate_all(cluster, tasks)
    jobs = [a.job_id for _, a in cluster.gateway.primaries]
    plans = [plan_of(cluster, job) for job in jobs]
    assert {p.runtime_key for p in plans} == {plans[0].runtime_key}
    assert plans[0].parallel == 4
    assert all(a.parallel == 4 for _, a in cluster.gateway.primaries)
    node = cluster.app.get_node(cluster.node_ids[0])
    assert sorted(node.jobs) == sorted(jobs) and node.state == "BUSY"
    assert count(cluster, "JOB_QUEUED") == 0
    # The fifth waits for a slot of that server and then runs on it.
    fifth = asyncio.create_task(cluster.jobs.start(submission("fifth"), cluster.model))
    await cluster.until(lambda: count(cluster, "JOB_QUEUED") == 1)
    await cluster.finish(cluster.node_ids[0], jobs[0])
    await cluster.primary_assigned(5)
    _, assignment = cluster.gateway.primaries[4]
    await cluster.validate(cluster.node_ids[0], assignment.job_id)
    await fifth
    assert plan_of(cluster, assignment.job_id).runtime_key == plans[0].runtime_key


async def test_a_warm_server_is_preferred_to_a_roomier_cold_node() -> None:
    cluster = Cluster(nodes=1, slots=4)
    first = await start_jobs(cluster, 1)
    await validate_all(cluster, first)
    warm_node = cluster.node_ids[0]
    roomy = cluster.add_node("roomy", ram=64 * GIB)  # joins later, far more free memory
    more = await start_jobs(cluster, 3, first=1)
    await validate_all(cluster, more, first=1)
    assert [node for node, _ in cluster.gateway.primaries] == [warm_node] * 4
    # Only when the warm server is full does a cold one start, on the roomy node.
    fifth = await start_jobs(cluster, 1, first=4)
    await validate_all(cluster, fifth, first=4)
    assert cluster.gateway.primaries[4][0] == roomy
    assert count(cluster, "JOB_QUEUED") == 0


async def test_a_finished_server_stays_warm_for_the_next_job() -> None:
    cluster = Cluster(nodes=1, slots=4)
    tasks = await start_jobs(cluster, 1)
    await validate_all(cluster, tasks)
    node, assignment = cluster.gateway.primaries[0]
    await cluster.finish(node, assignment.job_id)
    cluster.add_node("roomy", ram=64 * GIB)
    again = await start_jobs(cluster, 1, first=1)
    await validate_all(cluster, again, first=1)
    assert cluster.gateway.primaries[1][0] == node
    assert (
        plan_of(cluster, cluster.gateway.primaries[1][1].job_id).runtime_key
        == plan_of(cluster, assignment.job_id).runtime_key
    )


async def test_a_split_server_serves_its_slots_with_its_workers_shared() -> None:
    # 100 MiB each: the model needs two nodes; together they hold four slots.
    cluster = Cluster(nodes=1, slots=4, ram=100 * MIB)
    worker = cluster.add_node("worker", holds_model=False)
    tasks = [
        asyncio.create_task(cluster.jobs.start(submission(f"q{i}"), cluster.model))
        for i in range(4)
    ]
    answered = 0
    while answered < 8:  # each job starts the RPC workers of both nodes
        cluster.gateway.worker_asked.clear()
        for node, job in cluster.gateway.workers[answered:]:
            await cluster.jobs.handle(node, WorkerStatus(job, True, "127.0.0.1", 50052))
            answered += 1
        if answered < 8:
            await asyncio.wait_for(cluster.gateway.worker_asked.wait(), GUARD)
    await cluster.primary_assigned(4)
    for node, assignment in cluster.gateway.primaries:
        await cluster.validate(node, assignment.job_id)
    await asyncio.gather(*tasks)
    plans = [plan_of(cluster, a.job_id) for _, a in cluster.gateway.primaries]
    assert {p.runtime_key for p in plans} == {plans[0].runtime_key}
    assert plans[0].parallel == 4 and plans[0].node_ids == (cluster.node_ids[0], worker)
    assert len(cluster.app.get_node(worker).jobs) == 4  # one server's four slots, not four
    assert count(cluster, "JOB_QUEUED") == 0
    # Every worker start lets in the primary's address alone (the agent's RPC guard).
    primary_address = cluster.app.get_node(cluster.node_ids[0]).address
    assert set(cluster.gateway.allowed_peers) == {(primary_address,)}


async def test_memory_bounds_the_slots_of_a_server() -> None:
    # 179 MiB holds the model with two slots, not three.
    cluster = Cluster(nodes=1, slots=4, ram=179 * MIB)
    tasks = await start_jobs(cluster, 2)
    third = asyncio.create_task(cluster.jobs.start(submission("third"), cluster.model))
    await cluster.until(lambda: count(cluster, "JOB_QUEUED") == 1)
    await validate_all(cluster, tasks)
    assert plan_of(cluster, cluster.gateway.primaries[0][1].job_id).parallel == 2
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)


async def test_a_node_serving_one_model_takes_no_job_of_another_until_idle() -> None:
    cluster = Cluster(nodes=1, slots=4)
    other = {**cluster.model, "name": "other", "sha256": "b" * 64, "file_name": "other.gguf"}
    cluster.app.register_model("other", other["sha256"], other["file_name"], 2048)
    node = cluster.node_ids[0]
    cluster.hold_model(node, other)
    tasks = await start_jobs(cluster, 1)
    await validate_all(cluster, tasks)
    waiting = asyncio.create_task(cluster.jobs.start(submission("other"), other))
    await cluster.until(lambda: count(cluster, "JOB_QUEUED") == 1)
    await cluster.finish(node, cluster.gateway.primaries[0][1].job_id)
    await cluster.primary_assigned(2)
    _, assignment = cluster.gateway.primaries[1]
    assert assignment.model_name == "other"
    await cluster.validate(node, assignment.job_id)
    await waiting
