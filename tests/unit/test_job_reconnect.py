"""A primary's stream breaks and comes back: its executing jobs wait for it, the re-sent
tokens are relayed once (by sequence number), and a node that never comes back loses its
jobs (fake agent gateway, in-memory store, no sleeps)."""

from __future__ import annotations

import asyncio
from typing import Any

from application.agent_messages import TokensGenerated
from application.commands import Delta
from tests.unit.job_cluster import GUARD, Cluster, submission


def _texts(run: Any) -> list[str]:
    out: list[str] = []
    while not run.queue.empty():
        item = run.queue.get_nowait()
        out.extend(d.text for d in item.deltas)
        if item.kind != "deltas":
            out.append(item.kind)
    return out


async def test_an_executing_job_waits_for_its_primary_and_resumes_without_duplicates() -> None:
    cluster = Cluster(nodes=1)
    node, job, run = await cluster.running_job()
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "a"), Delta(1, "b")]))
    cluster.jobs.node_disconnected(node)
    assert job in cluster.jobs.runs  # not lost: it waits
    assert cluster.jobs.resumed_jobs(node) == [(job, 2)]
    # The agent re-sends from what it last knew was received: 1 is a duplicate, 2-3 new.
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(1, "b"), Delta(2, "c")]))
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(2, "c")]))
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(3, "d")]))
    await cluster.finish(node, job)
    assert _texts(run) == ["a", "b", "c", "d", "done"]
    await cluster.until(lambda: cluster.job_codes(job)[-1] == "JOB_COMPLETED")
    assert cluster.app.get_node(node).jobs == []


async def test_a_gap_is_relayed_and_logged_not_dropped(caplog: Any) -> None:
    cluster = Cluster(nodes=1)
    node, job, run = await cluster.running_job()
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "a")]))
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(3, "d")]))
    assert _texts(run) == ["a", "d"]
    assert "tokens 1 to 2 never arrived" in caplog.text
    assert cluster.jobs.resumed_jobs(node) == [(job, 4)]


async def test_a_node_that_stays_away_loses_its_executing_jobs() -> None:
    cluster = Cluster(nodes=1)
    node, job, run = await cluster.running_job()
    cluster.jobs.node_disconnected(node)
    await cluster.jobs.node_gone(node)
    item = run.queue.get_nowait()
    assert (item.kind, item.error_code) == ("error", "node_lost")
    await cluster.until(lambda: cluster.job_codes(job)[-1] == "JOB_FAILED")
    assert cluster.jobs.resumed_jobs(node) == []


async def test_a_setup_waiting_for_a_disconnected_primary_fails_over_at_once() -> None:
    cluster = Cluster(nodes=2)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(first, job)] = await cluster.primary_assigned(1)
    assert cluster.jobs.resumed_jobs(first) == []  # in setup: nothing to resume
    cluster.jobs.node_disconnected(first)
    [_, (second, again)] = await cluster.primary_assigned(2)
    assert again == job and second != first  # re-planned without the lost node
    await cluster.validate(second, job)
    await asyncio.wait_for(task, GUARD)
    assert "JOB_REPLANNED" in cluster.job_codes(job)
