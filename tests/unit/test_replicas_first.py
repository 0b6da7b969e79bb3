"""Replicas before splits (domain/split_planner.py, the tiers of domain/placement.py): every plan
of one node comes before any split over llama.cpp RPC, which decodes slower than one node does;
where one node holds the model, more load runs another replica on another node."""

from __future__ import annotations

import asyncio
from typing import Any

from domain.placement import (
    GIB,
    MIB,
    TIER_CPU,
    TIER_CPU_OVER_RPC,
    TIER_GPUS_AND_HOST,
    TIER_GPUS_OVER_RPC,
    TIERS,
)
from domain.split_planner import plan_placement
from tests.unit.job_cluster import GUARD, Cluster, count, submission
from tests.unit.test_device_placement import node, request

SPLITS = (TIER_GPUS_OVER_RPC, TIER_CPU_OVER_RPC)


def test_every_one_node_tier_comes_before_every_split() -> None:
    assert TIERS[-len(SPLITS) :] == SPLITS
    assert not set(SPLITS) & set(TIERS[: -len(SPLITS)])


def test_a_small_gpu_and_much_ram_beat_a_gpu_split_over_rpc() -> None:
    """An 8 GiB card and 64 GiB of RAM on the file's node hold 32 GiB alone; a 40 GiB card
    elsewhere would hold it in GPUs, but only as a split."""
    nodes = [node("a", 8 * GIB, ram=64 * GIB, model=True), node("b", 40 * GIB)]
    plan = plan_placement(request(32 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_GPUS_AND_HOST
    assert plan.node_ids == ("a",) and plan.workers == ()
    assert plan.reasons[0].startswith(f"{TIER_GPUS_AND_HOST}: no node's GPUs hold it alone;")


def test_one_nodes_host_memory_beats_a_gpu_split() -> None:
    """No GPU at all on the file's node, 64 GiB of RAM: it runs the model, not a split onto the
    GPU box."""
    nodes = [node("a", ram=64 * GIB, model=True), node("b", 24 * GIB)]
    plan = plan_placement(request(20 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_CPU and plan.node_ids == ("a",)


def test_one_nodes_cpu_beats_a_cpu_split_when_it_holds_the_model() -> None:
    nodes = [node("a", ram=16 * GIB, model=True), node("b", ram=16 * GIB, model=True)]
    plan = plan_placement(request(12 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_CPU
    assert len(plan.node_ids) == 1 and plan.devices == ()
    assert plan.reasons[0].startswith(f"{TIER_CPU}: no GPU takes part;")


def test_a_gpu_split_when_no_single_node_holds_the_model() -> None:
    nodes = [node("a", 24 * GIB, ram=16 * GIB, model=True), node("b", 24 * GIB, ram=16 * GIB)]
    plan = plan_placement(request(40 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_GPUS_OVER_RPC
    assert plan.node_ids == ("a", "b")
    assert plan.reasons[0].startswith(
        f"{TIER_GPUS_OVER_RPC}: no node with the model file holds it alone"
    )


def test_a_cpu_split_when_no_single_node_holds_the_model() -> None:
    nodes = [node("a", ram=16 * GIB, model=True), node("b", ram=16 * GIB, model=True)]
    plan = plan_placement(request(24 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_CPU_OVER_RPC
    assert len(plan.node_ids) == 2
    assert plan.reasons[0].startswith(
        f"{TIER_CPU_OVER_RPC}: no node with the model file holds it alone and no GPU takes part;"
    )


async def test_two_concurrent_jobs_run_on_two_replicas_not_a_split_nor_a_queue() -> None:
    """Two single-slot nodes each hold a model that fits one of them: two long jobs at once get
    a one-node server each (the second on the idle node), neither waits, no RPC worker starts."""
    cluster = Cluster(nodes=2)
    first = asyncio.create_task(cluster.jobs.start(submission("one"), cluster.model))
    second = asyncio.create_task(cluster.jobs.start(submission("two"), cluster.model))
    assigned = await cluster.primary_assigned(2)
    assert {n for n, _ in assigned} == set(cluster.node_ids)
    assert cluster.gateway.workers == []
    for node_id, job_id in assigned:
        await cluster.validate(node_id, job_id)
    await asyncio.gather(first, second)
    for node_id, job_id in assigned:
        plan = cluster.app.get_job(job_id).plan
        assert plan is not None and plan["tier"] == TIER_CPU
        assert plan["primary"]["node_id"] == node_id and plan["workers"] == []
    assert count(cluster, "JOB_QUEUED") == 0


class RecordingFetcher:
    """A ModelFetcher that records what it is asked (a fake: it fetches nothing)."""

    def __init__(self) -> None:
        self.replicas: list[str] = []

    def fetch_for(self, model: dict[str, Any]) -> bool:
        return False

    def fetch_replica(self, model: dict[str, Any]) -> bool:
        self.replicas.append(model["name"])
        return True


async def test_a_cold_split_serves_now_and_fetches_a_replica_for_the_next_jobs() -> None:
    """The node holding the file is too small alone; a roomy node lacks it: the job runs split
    over both at once, and the roomy node is asked to fetch the file (as a replica's primary it
    then takes the load the split cannot); a one-node plan fetches nothing."""
    fetcher = RecordingFetcher()
    cluster = Cluster(nodes=1, ram=60 * MIB, fetcher=fetcher)
    cluster.add_node("roomy", holds_model=False, ram=8 * GIB)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))

    async def split_started() -> None:  # the split starts its RPC workers
        while not cluster.gateway.workers:
            cluster.gateway.worker_asked.clear()
            if not cluster.gateway.workers:
                await cluster.gateway.worker_asked.wait()

    await asyncio.wait_for(split_started(), GUARD)
    assert fetcher.replicas == [cluster.model["name"]]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    alone = RecordingFetcher()
    one = Cluster(nodes=1, fetcher=alone)
    await one.running_job()
    assert alone.replicas == []
