"""Idle RPC workers are stopped after RPC_WORKER_IDLE_GRACE, idle llama-servers after
SERVER_IDLE_GRACE (application/runtime_reaper.py),
through the real job manager, scheduler and reaper on an in-memory store with a fake agent
gateway. The clock is the reaper's argument: no sleeps."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

from application.agent_messages import WorkerStatus
from application.runtime_reaper import RuntimeReaper, idle_runtime, idle_worker
from domain.errors import IllegalTransition
from domain.placement import ExecutionPlan
from infrastructure.settings import Settings, SettingsError
from tests.unit.job_cluster import GUARD, Cluster, count, submission

MIB = 1 << 20
GRACE = 300.0


async def split_job(cluster: Cluster, first: int) -> str:
    """Runs one job on the split server (primary + worker) to its end; returns its id."""
    task = asyncio.create_task(cluster.jobs.start(submission(f"q{first}"), cluster.model))
    answered = 2 * first
    while answered < 2 * first + 2:  # the job starts the RPC workers of both nodes
        cluster.gateway.worker_asked.clear()
        for node, job in cluster.gateway.workers[answered:]:
            await cluster.jobs.handle(node, WorkerStatus(job, True, "127.0.0.1", 50052))
            answered += 1
        if answered < 2 * first + 2:
            await asyncio.wait_for(cluster.gateway.worker_asked.wait(), GUARD)
    (node, job_id), *_ = (await cluster.primary_assigned(first + 1))[first:]
    await cluster.validate(node, job_id)
    await task
    await cluster.finish(node, job_id)
    return job_id


def split_cluster() -> tuple[Cluster, str, str]:
    """100 MiB of RAM per node: the model needs both."""
    cluster = Cluster(nodes=1, slots=2, ram=100 * MIB)
    worker = cluster.add_node("worker", holds_model=False)
    return cluster, cluster.node_ids[0], worker


def idle_since(cluster: Cluster, node_id: str) -> float:
    row = cluster.read.get_node(node_id)
    assert row is not None and row["idle_since"] is not None
    return dt.datetime.fromisoformat(row["idle_since"]).timestamp()


def reaper(cluster: Cluster, server_grace: float = 3 * GRACE) -> RuntimeReaper:
    return RuntimeReaper(cluster.app, cluster.read, cluster.gateway, GRACE, server_grace)


def plan_of(cluster: Cluster, job_id: str) -> ExecutionPlan:
    job = cluster.app.get_job(job_id)
    assert job.plan is not None
    return ExecutionPlan.from_dict(job.plan)


async def test_an_idle_worker_is_stopped_after_the_grace_and_its_server_is_cold_again() -> None:
    cluster, primary, worker = split_cluster()
    first = await split_job(cluster, 0)
    since = idle_since(cluster, worker)

    assert await reaper(cluster).sweep(since + GRACE - 1) == []  # still kept for warm reuse
    assert cluster.gateway.worker_stops == []
    assert sorted(await reaper(cluster).sweep(since + GRACE)) == sorted([primary, worker])
    assert [node for node, _ in cluster.gateway.worker_stops] == [worker]
    assert "RPC_WORKER_IDLE_GRACE=300" in cluster.gateway.worker_stops[0][1]
    # the split's primary goes with its workers: its server cannot serve without them
    assert [node for node, _ in cluster.gateway.server_stops] == [primary]
    assert "its workers' grace" in cluster.gateway.server_stops[0][1]
    assert count(cluster, "NODE_RUNTIME_RETIRED") == 2
    assert cluster.app.get_node(worker).runtime is None
    assert cluster.app.get_node(primary).runtime is None
    assert await reaper(cluster).sweep(since + 2 * GRACE) == []  # once

    # The next job starts the server again (and its workers) rather than reuse a dead one.
    second = await split_job(cluster, 1)
    assert plan_of(cluster, second).node_ids == plan_of(cluster, first).node_ids
    assert cluster.gateway.workers[-2:] == [(primary, second), (worker, second)]


async def test_a_worker_in_use_is_never_stopped() -> None:
    cluster, _, worker = split_cluster()
    await split_job(cluster, 0)
    since = idle_since(cluster, worker)
    # A job arrives: the worker holds it while its setup runs.
    task = asyncio.create_task(cluster.jobs.start(submission("busy"), cluster.model))
    await cluster.until(lambda: bool(cluster.app.get_node(worker).jobs))
    row = cluster.read.get_node(worker)
    assert row is not None and idle_worker(row, since + 10 * GRACE, GRACE) is None
    assert await reaper(cluster).sweep(since + 10 * GRACE) == []
    assert cluster.gateway.worker_stops == []
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_job_assigned_after_the_decision_wins_over_the_retirement() -> None:
    cluster, _, worker = split_cluster()
    await split_job(cluster, 0)
    node = cluster.app.get_node(worker)
    key: Any = node.runtime["key"] if node.runtime else None
    task = asyncio.create_task(cluster.jobs.start(submission("late"), cluster.model))
    await cluster.until(lambda: bool(cluster.app.get_node(worker).jobs))
    with pytest.raises(IllegalTransition, match="holds 1 job"):
        cluster.app.retire_runtime(worker, key, GRACE)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_worker_whose_agent_is_not_connected_here_is_left_to_its_controller() -> None:
    cluster, primary, worker = split_cluster()
    await split_job(cluster, 0)
    cluster.gateway.disconnected.add(worker)
    assert await reaper(cluster).sweep(idle_since(cluster, worker) + GRACE) == [primary]
    assert count(cluster, "NODE_RUNTIME_RETIRED") == 1  # the primary's, connected here
    assert cluster.app.get_node(worker).runtime is not None
    assert cluster.gateway.worker_stops == []


async def one_node_job(cluster: Cluster, text: str = "hi") -> str:
    """Runs one job on the cluster's one-node server to its end; returns its node."""
    before = len(cluster.gateway.primaries)
    task = asyncio.create_task(cluster.jobs.start(submission(text), cluster.model))
    (node, job_id), *_ = (await cluster.primary_assigned(before + 1))[before:]
    await cluster.validate(node, job_id)
    await task
    await cluster.finish(node, job_id)
    return node


async def test_an_idle_one_node_server_is_stopped_after_its_own_grace() -> None:
    """SERVER_IDLE_GRACE, not the workers': a model reload costs more than a worker start.
    The retired server's cache is forgotten, and the next job plans a new server."""
    cluster = Cluster(nodes=1, slots=2)
    node = await one_node_job(cluster)
    since = idle_since(cluster, node)
    forgotten: list[str] = []
    reaper_ = RuntimeReaper(
        cluster.app, cluster.read, cluster.gateway, GRACE, 3 * GRACE, forget=forgotten.append
    )
    runtime = cluster.app.get_node(node).runtime
    assert runtime is not None
    key = runtime["key"]
    assert await reaper_.sweep(since + GRACE) == []  # a worker's grace is not a server's
    assert await reaper_.sweep(since + 3 * GRACE) == [node]
    assert cluster.gateway.server_stops == [(node, "idle for 900 s (SERVER_IDLE_GRACE=900)")]
    assert cluster.gateway.worker_stops == []
    assert forgotten == [f"{node}/{key}"]
    assert cluster.app.get_node(node).runtime is None
    assert await reaper_.sweep(since + 10 * GRACE) == []  # once
    assert await one_node_job(cluster, "again") == node  # a cold plan starts it again
    assert count(cluster, "JOB_COMPLETED") == 2


async def test_a_server_in_use_is_never_stopped() -> None:
    cluster = Cluster(nodes=1, slots=2)
    node = await one_node_job(cluster)
    since = idle_since(cluster, node)
    task = asyncio.create_task(cluster.jobs.start(submission("busy"), cluster.model))
    await cluster.until(lambda: bool(cluster.app.get_node(node).jobs))
    row = cluster.read.get_node(node)
    assert row is not None and idle_runtime(row, since + 10 * GRACE, GRACE, GRACE) is None
    assert await reaper(cluster).sweep(since + 10 * GRACE) == []
    assert cluster.gateway.server_stops == []
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_the_graces_are_positive_settings() -> None:
    assert Settings.from_env({}).rpc_worker_idle_grace == 300.0
    assert Settings.from_env({"RPC_WORKER_IDLE_GRACE": "30"}).rpc_worker_idle_grace == 30.0
    with pytest.raises(SettingsError, match="RPC_WORKER_IDLE_GRACE"):
        Settings.from_env({"RPC_WORKER_IDLE_GRACE": "0"})
    assert Settings.from_env({}).server_idle_grace == 900.0
    assert Settings.from_env({"SERVER_IDLE_GRACE": "60"}).server_idle_grace == 60.0
    with pytest.raises(SettingsError, match="SERVER_IDLE_GRACE"):
        Settings.from_env({"SERVER_IDLE_GRACE": "-1"})
