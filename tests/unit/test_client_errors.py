"""A request a node refuses as invalid is the client's error (issue 26): the job ends
JOB_REJECTED, not JOB_FAILED, its node is released as "rejected", and `dacp diagnose` counts
no failed job against the node. The real job manager on the in-memory store, a fake gateway."""

from __future__ import annotations

import asyncio

import pytest

from application.agent_messages import AgentJobResult, JobFinished
from application.diagnosis import diagnose
from application.version import CONTROLLER_VERSION
from common.contract import (
    CLIENT_ERROR_CODES,
    CONTEXT_LENGTH_EXCEEDED,
    OUT_OF_MEMORY,
    REQUEST_REJECTED,
)
from tests.unit.job_cluster import GUARD, Cluster, submission


async def _ended_with(error_code: str) -> tuple[Cluster, str, str]:
    cluster = Cluster(1)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job_id)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job_id)
    await asyncio.wait_for(task, GUARD)
    result = AgentJobResult(ok=False, error="the prompt does not fit", error_code=error_code)
    await cluster.jobs.handle(node, JobFinished(job_id, result))
    await cluster.jobs.settle()
    return cluster, node, job_id


def test_the_client_error_codes_are_the_400s() -> None:
    assert {CONTEXT_LENGTH_EXCEEDED, REQUEST_REJECTED} == CLIENT_ERROR_CODES


@pytest.mark.parametrize("code", sorted(CLIENT_ERROR_CODES))
async def test_a_refused_request_is_rejected_not_failed(code: str) -> None:
    cluster, node, job_id = await _ended_with(code)
    assert cluster.job_codes(job_id)[-1] == "JOB_REJECTED"
    job = cluster.read.get_job(job_id)
    assert job is not None
    assert (job["state"], job["error_code"]) == ("REJECTED", code)
    released = [e for e in cluster._events(node) if type(e).__name__ == "JobReleased"]
    assert released[-1].outcome == "rejected"
    row = cluster.read.get_node(node)
    assert row is not None
    report = diagnose(row, [], [job], CONTROLLER_VERSION)
    assert report["failed_jobs"] == []


async def test_a_node_failure_is_still_a_failure() -> None:
    cluster, node, job_id = await _ended_with(OUT_OF_MEMORY)
    assert cluster.job_codes(job_id)[-1] == "JOB_FAILED"
    job = cluster.read.get_job(job_id)
    assert job is not None and job["state"] == "FAILED"
    row = cluster.read.get_node(node)
    assert row is not None
    assert [j["job_id"] for j in diagnose(row, [], [job], CONTROLLER_VERSION)["failed_jobs"]] == [
        job_id
    ]
