"""Refused agent messages: what is malformed or out of order (the bridge and the job manager
say why), and how often a refusal is recorded."""

from __future__ import annotations

import asyncio

from application.agent_messages import (
    AgentJobResult,
    JobFinished,
    Rejection,
    SetupOutcome,
    SetupReported,
    TokensGenerated,
    WorkerStatus,
)
from application.commands import Delta
from application.rejections import RejectionAudit
from interfaces.grpc.agent_bridge import job_message
from tests.unit.job_cluster import GUARD, Cluster, submission
from wire import control_pb2 as pb


def chunk(job_id: str, *seqs: int) -> pb.AgentMessage:
    deltas = [pb.Delta(seq=s, text="x", tokens=1) for s in seqs]
    return pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job_id, deltas=deltas))


def test_malformed_job_messages_are_refused_with_a_reason() -> None:
    refused = {
        "no deltas": chunk("j"),
        "no job id": chunk("", 0),
        "out of order": chunk("j", 3, 2),
        "repeated": chunk("j", 1, 1),
        "no state": pb.AgentMessage(rpc_worker_status=pb.RpcWorkerStatus(job_id="j")),
        "result without job": pb.AgentMessage(job_result=pb.JobResult(ok=True)),
        "setup without job": pb.AgentMessage(setup_result=pb.SetupResult(ok=True)),
    }
    for name, message in refused.items():
        assert isinstance(job_message(message), Rejection), name
    assert isinstance(job_message(chunk("j", 4, 5, 7)), TokensGenerated)
    assert job_message(pb.AgentMessage(heartbeat=pb.Heartbeat())) is None  # not a job message


def test_one_refusal_per_node_is_recorded_per_interval_counting_the_rest() -> None:
    audit = RejectionAudit(interval=10.0)
    assert audit.note("a", 100.0) == 0
    assert audit.note("a", 101.0) is None
    assert audit.note("b", 101.0) == 0  # another node has its own interval
    assert audit.note("a", 105.0) is None
    assert audit.note("a", 110.5) == 2  # the two in between
    assert audit.note("a", 111.0) is None


async def _executing(cluster: Cluster) -> tuple[str, str]:
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job)] = await cluster.primary_assigned(1)
    await cluster.validate(node, job)
    await asyncio.wait_for(task, GUARD)
    return node, job


async def test_messages_about_a_job_the_node_has_no_part_in_are_refused() -> None:
    cluster = Cluster(nodes=2)
    node, job = await _executing(cluster)
    [other] = [n for n in cluster.node_ids if n != node]
    jobs = cluster.jobs
    tokens = TokensGenerated(job, [Delta(0, "x")])
    assert isinstance(await jobs.handle(other, tokens), Rejection)
    assert isinstance(
        await jobs.handle(other, SetupReported(job, SetupOutcome(ok=True))), Rejection
    )
    result = JobFinished(job, AgentJobResult(ok=True))
    assert isinstance(await jobs.handle(other, result), Rejection)
    assert isinstance(await jobs.handle(other, WorkerStatus(job, True)), Rejection)
    assert await jobs.handle(node, tokens) is None  # its own primary: relayed
    # Messages about a job that has ended, or that never ran here, are late, not wrong.
    assert await jobs.handle(other, TokensGenerated("gone", [Delta(0, "x")])) is None


async def test_tokens_or_a_result_before_the_setup_result_are_refused() -> None:
    cluster = Cluster(nodes=1)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job)] = await cluster.primary_assigned(1)
    early = await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "x")]))
    assert isinstance(early, Rejection) and "before" in early.reason
    done = await cluster.jobs.handle(node, JobFinished(job, AgentJobResult(ok=True)))
    assert isinstance(done, Rejection)
    await cluster.validate(node, job)  # the job goes on as if they were never sent
    run = await asyncio.wait_for(task, GUARD)
    assert await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "y")])) is None
    item = run.queue.get_nowait()
    assert [d.text for d in item.deltas] == ["y"]


async def test_a_late_answer_from_an_earlier_plan_is_dropped_quietly() -> None:
    cluster = Cluster(nodes=2)
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(first, job)] = await cluster.primary_assigned(1)
    failed = SetupOutcome(ok=False, error="no", error_code="X", failed_node_id=first)
    await cluster.jobs.handle(first, SetupReported(job, failed))
    [_, (second, _)] = await cluster.primary_assigned(2)
    assert await cluster.jobs.handle(first, SetupReported(job, SetupOutcome(ok=True))) is None
    assert await cluster.jobs.handle(first, JobFinished(job, AgentJobResult(ok=False))) is None
    await cluster.validate(second, job)
    await asyncio.wait_for(task, GUARD)


async def test_a_setup_failure_after_a_good_setup_fails_the_job_at_once() -> None:
    """An agent whose own fault after the setup reaches its catch-all reports a setup failure;
    the job fails then (an execution failure, its slot freed) instead of waiting forever."""
    cluster = Cluster(nodes=1)
    node, job, run = await cluster.running_job()
    await cluster.jobs.handle(node, TokensGenerated(job, [Delta(0, "x")]))
    failed = SetupOutcome(ok=False, error="handler failed: KeyError: 'x'", error_code="AGENT_ERROR")
    assert await cluster.jobs.handle(node, SetupReported(job, failed)) is None
    await cluster.jobs.settle()
    items = [run.queue.get_nowait() for _ in range(run.queue.qsize())]
    assert [i.kind for i in items] == ["deltas", "error"]
    assert items[-1].error_code == "execution_failed"
    assert "handler failed: KeyError" in items[-1].error
    await cluster.until(lambda: cluster.job_codes(job)[-1] == "JOB_FAILED")
    released = [e for e in cluster._events(node) if type(e).__name__ == "JobReleased"]
    assert [e.outcome for e in released] == ["failed"]
