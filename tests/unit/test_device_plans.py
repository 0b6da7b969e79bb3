"""Device plans through the job manager (issue 22), on the in-memory store with the fake agent
gateway: the devices a plan names reach the primary (``--device``, shares, ``--n-gpu-layers``)
and the RPC workers (``ggml-rpc-server -d``); an out-of-memory before the first token lowers
that device's budget and re-plans without excluding its node; after the first token it ends
the job with ``out_of_memory`` and the next plan gives the device less."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

from application.agent_messages import (
    AgentJobResult,
    JobFinished,
    SetupOutcome,
    SetupReported,
    TokensGenerated,
    WorkerStatus,
)
from application.commands import Delta
from application.job_run import StreamItem
from common.contract import OUT_OF_MEMORY
from domain.placement import HOST_DEVICE, TIER_CPU_OVER_RPC, TIER_ONE_DEVICE
from tests.unit.job_cluster import GUARD, Cluster, submission

MIB = 1 << 20
GIB = 1 << 30


def give_gpu(cluster: Cluster, node_id: str, name: str, free: int, protocol: str = "7.0.0") -> None:
    """The node reports a GPU (and its host CPU) as llama.cpp lists them: a new report, as
    the agent's are (the controller keeps the node as last saved, holding the report it had)."""
    resources = dict(cluster._resources[node_id])
    cluster._resources[node_id] = resources
    devices = [d for d in resources.get("devices", []) if d["kind"] == "gpu"]
    devices.append(
        {
            "name": name,
            "description": "Fake GPU",
            "kind": "gpu",
            "memory_total_bytes": free,
            "memory_free_bytes": free,
            "uuid": "",
        }
    )
    ram = resources["ram_total_bytes"]
    host = {
        "name": HOST_DEVICE,
        "description": "Fake CPU",
        "kind": "cpu",
        "memory_total_bytes": ram,
        "memory_free_bytes": ram,
        "uuid": "",
    }
    resources["devices"] = [*devices, host]
    resources["rpc_protocol"] = protocol
    cluster.app.report_resources(node_id, resources, list(cluster._held[node_id]))


async def answer_workers(cluster: Cluster, count: int) -> None:
    answered = 0
    while answered < count:
        cluster.gateway.worker_asked.clear()
        for node, job in cluster.gateway.workers[answered:]:
            await cluster.jobs.handle(node, WorkerStatus(job, True, "127.0.0.1", 50052))
            answered += 1
        if answered < count:
            await asyncio.wait_for(cluster.gateway.worker_asked.wait(), GUARD)


async def workers_asked(cluster: Cluster, count: int) -> None:
    """Waits until ``count`` RPC workers were asked for (no save marks that)."""
    while len(cluster.gateway.workers) < count:
        cluster.gateway.worker_asked.clear()
        if len(cluster.gateway.workers) < count:
            await asyncio.wait_for(cluster.gateway.worker_asked.wait(), GUARD)


def replanned_events(cluster: Cluster, job_id: str) -> list[Any]:
    return [e for e in cluster.app.events.get(UUID(job_id)) if type(e).__name__ == "Replanned"]


async def test_a_gpu_that_holds_the_model_runs_it_alone_without_rpc() -> None:
    cluster = Cluster(nodes=1)
    node = cluster.node_ids[0]
    give_gpu(cluster, node, "CUDA0", 4 * GIB)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(_, job_id)] = await cluster.primary_assigned(1)
    _, assignment = cluster.gateway.primaries[0]
    assert [(d.node_id, d.device, d.endpoint) for d in assignment.devices] == [(node, "CUDA0", "")]
    assert assignment.devices[0].share == 1.0 and assignment.devices[0].assigned_bytes > 0
    assert assignment.rpc_peers == () and cluster.gateway.workers == []
    await cluster.validate(node, job_id)
    await task
    plan = cluster.app.get_job(job_id).plan
    assert plan is not None and plan["tier"] == TIER_ONE_DEVICE and plan["reasons"]


async def test_a_cpu_split_names_each_nodes_cpu_for_its_rpc_worker() -> None:
    cluster = Cluster(nodes=1, ram=100 * MIB)  # one node cannot hold the model
    primary = cluster.node_ids[0]
    worker = cluster.add_node("worker", holds_model=False)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    await answer_workers(cluster, 2)
    [(_, job_id)] = await cluster.primary_assigned(1)
    assert sorted(cluster.gateway.worker_devices) == sorted(
        [(primary, (HOST_DEVICE,)), (worker, (HOST_DEVICE,))]
    )
    _, assignment = cluster.gateway.primaries[0]
    assert [d.device for d in assignment.devices] == [HOST_DEVICE, HOST_DEVICE]
    assert {d.node_id for d in assignment.devices} == {primary, worker}
    assert all(d.endpoint == "127.0.0.1:50052" for d in assignment.devices)
    assert abs(sum(d.share for d in assignment.devices) - 1.0) < 1e-6
    await cluster.validate(primary, job_id)
    await task
    plan = cluster.app.get_job(job_id).plan
    assert plan is not None and plan["tier"] == TIER_CPU_OVER_RPC


async def test_an_out_of_memory_at_load_lowers_that_device_and_replans_on_the_same_node() -> None:
    cluster = Cluster(nodes=1)
    node = cluster.node_ids[0]
    # Big enough on paper, so the first plan puts everything on it; it is not, in truth.
    give_gpu(cluster, node, "CUDA0", 1 * GIB)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(_, job_id)] = await cluster.primary_assigned(1)
    _, first = cluster.gateway.primaries[0]
    assert [d.device for d in first.devices] == ["CUDA0"]
    planned = first.devices[0].assigned_bytes
    oom = SetupOutcome(
        ok=False,
        error="cudaMalloc failed: out of memory",
        error_code=OUT_OF_MEMORY,
        failed_node_id=node,
        failed_device="CUDA0",
        failed_bytes=300 * MIB,
    )
    await cluster.jobs.handle(node, SetupReported(job_id, oom))
    await cluster.primary_assigned(2)
    second_node, second = cluster.gateway.primaries[1]
    # The same node, now without the device that ran out: its host memory takes the model.
    assert second_node == node
    assert "CUDA0" not in [d.device for d in second.devices]
    await cluster.validate(node, job_id)
    await task
    [replanned] = replanned_events(cluster, job_id)
    assert replanned.excluded_node == ""
    assert replanned.out_of_memory == {
        "node_id": node,
        "device": "CUDA0",
        "planned_bytes": planned,
        "asked_bytes": 300 * MIB,
    }
    assert "CUDA0" in replanned.reason and OUT_OF_MEMORY in replanned.reason
    cap = cluster.jobs.scheduler.budgets.cap(node, "CUDA0")
    assert cap is not None and cap < planned


async def test_a_worker_that_runs_out_of_memory_is_named_with_its_device() -> None:
    cluster = Cluster(nodes=1, ram=100 * MIB)
    primary = cluster.node_ids[0]
    worker = cluster.add_node("worker", holds_model=False)
    cluster.add_node("spare", holds_model=False)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    await workers_asked(cluster, 2)
    job_id = cluster.gateway.workers[0][1]
    used = [n for n, _ in cluster.gateway.workers]
    failing = worker if worker in used else next(n for n in used if n != primary)
    for node, job in list(cluster.gateway.workers):
        if node == failing:
            status = WorkerStatus(
                job,
                False,
                error="ggml-rpc-server: failed to allocate buffer",
                error_code=OUT_OF_MEMORY,
                failed_device=HOST_DEVICE,
                failed_bytes=90 * MIB,
            )
        else:
            status = WorkerStatus(job, True, "127.0.0.1", 50052)
        await cluster.jobs.handle(node, status)
    await cluster.until(lambda: bool(replanned_events(cluster, job_id)))
    [replanned] = replanned_events(cluster, job_id)
    assert replanned.out_of_memory["node_id"] == failing
    assert replanned.out_of_memory["device"] == HOST_DEVICE
    assert replanned.out_of_memory["planned_bytes"] > 0
    assert cluster.jobs.scheduler.budgets.cap(failing, HOST_DEVICE) is not None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_an_out_of_memory_after_the_first_token_is_out_of_memory_for_the_client() -> None:
    cluster = Cluster(nodes=1)
    node = cluster.node_ids[0]
    give_gpu(cluster, node, "CUDA0", 4 * GIB)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(_, job_id)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job_id)
    run = await asyncio.wait_for(task, GUARD)
    await cluster.jobs.handle(node, TokensGenerated(job_id, [Delta(0, "Hel", 1)]))
    failed = AgentJobResult(
        ok=False,
        error="CUDA error: out of memory",
        error_code=OUT_OF_MEMORY,
        failed_node_id=node,
        failed_device="CUDA0",
        failed_bytes=64 * MIB,
    )
    await cluster.jobs.handle(node, JobFinished(job_id, failed))
    await cluster.jobs.settle()
    items: list[StreamItem] = []
    while not run.queue.empty():
        items.append(run.queue.get_nowait())
    assert items[-1].kind == "error" and items[-1].error_code == OUT_OF_MEMORY
    assert "CUDA0" in items[-1].error
    assert cluster.app.get_job(job_id).state == "FAILED"
    assert cluster.jobs.scheduler.budgets.cap(node, "CUDA0") is not None
