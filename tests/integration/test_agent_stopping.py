"""An agent that stops on purpose, over real gRPC, Postgres and Redis (the agent a raw session
or a FakeAgent; the real agent and llama.cpp in tests/e2e/test_graceful_stop.py): its
``Stopping`` drains the node (NODE_STOPPING, no new job), its ``Goodbye`` stops it
(NODE_STOPPED), cleanly or with the jobs it still held lost for the reason it gave."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from interfaces.controller_main import RunningController
from tests.integration.control_client import RawSession
from tests.integration.test_control_plane import codes, ready_node, target, wait_for
from tests.integration.test_job_flow import chat_stream, ctl, slow_primary, synced
from wire import control_pb2 as pb

__all__ = ["ctl"]  # the fixture


def _last_event(ctl: RunningController, node_id: str) -> Any:
    return list(ctl.services.app.repository.event_store.get(UUID(node_id)))[-1]


async def test_a_stopping_node_drains_then_stops_cleanly_and_serves_again_later(
    ctl: RunningController,
) -> None:
    node_id, session = await ready_node(ctl)
    read = ctl.services.read_model
    await session.send(pb.AgentMessage(stopping=pb.Stopping(drain_timeout_seconds=60)))
    await wait_for(lambda: read.get_node(node_id)["state"] == "DRAINING")  # type: ignore[index]
    assert read.get_node(node_id)["stopping"]  # type: ignore[index]
    assert node_id not in {row["node_id"] for row in read.eligibility()}
    stopping = _last_event(ctl, node_id)
    assert (stopping.code, stopping.drain_timeout_seconds) == ("NODE_STOPPING", 60.0)
    await session.close("drained (0 job(s) finished)")
    await wait_for(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]
    assert codes(ctl, node_id)[-2:] == ["NODE_STOPPING", "NODE_STOPPED"]
    stopped = _last_event(ctl, node_id)
    assert (stopped.reason, stopped.lost_jobs) == ("drained (0 job(s) finished)", [])
    # Restarted, the agent serves again: the stop's drain ended with it.
    again = RawSession(target(ctl), node_id, session.credential)
    await again.open()
    again.start_heartbeats()
    await wait_for(lambda: read.get_node(node_id)["state"] == "READY")  # type: ignore[index]
    assert not read.get_node(node_id)["stopping"]  # type: ignore[index]
    await again.close()


async def test_a_job_that_outlasts_the_drain_is_lost_with_the_drains_reason(
    ctl: RunningController,
) -> None:
    a = await slow_primary(ctl)
    assert a.session is not None
    reason = "its drain timed out after 1 s with 1 job(s) running"
    async with chat_stream(ctl) as r:
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 6:
                stopping = pb.Stopping(drain_timeout_seconds=1)
                await a.session.send(pb.AgentMessage(stopping=stopping))
                await a.session.close(reason)
    errors = [line for line in lines if '"error"' in line]
    assert errors and f"its agent stopped ({reason})" in errors[0]
    [row] = synced(ctl).services.read_model.list_jobs()
    job = ctl.services.app.get_job(row["job_id"])
    assert job.state == "FAILED" and job.failure_phase == "execution"
    assert reason in str(job.failure_reason)
    node_id = row["nodes"][0]
    assert codes(ctl, node_id)[-2:] == ["NODE_STOPPING", "NODE_STOPPED"]
    stopped = _last_event(ctl, node_id)
    assert (stopped.reason, stopped.lost_jobs) == (reason, [row["job_id"]])


async def test_a_job_that_ends_right_before_the_goodbye_completes_and_is_not_lost(
    ctl: RunningController,
) -> None:
    """The drain's last result and the goodbye arrive back to back on the stream: the result
    is handled first, so the job completes and NODE_STOPPED lists nothing lost."""
    a = await slow_primary(ctl, words=30)
    session = a.session
    assert session is not None
    send = session.send

    async def goodbye_after_the_result(message: pb.AgentMessage) -> None:
        await send(message)
        if message.WhichOneof("payload") == "job_result":
            session.stop_heartbeats()
            await send(pb.AgentMessage(goodbye=pb.Goodbye(reason="drained (1 job(s) finished)")))
            await session.outbox.put(None)  # the agent ends its stream

    session.send = goodbye_after_the_result  # type: ignore[method-assign]
    async with chat_stream(ctl) as r:
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 2:
                await send(pb.AgentMessage(stopping=pb.Stopping(drain_timeout_seconds=60)))
    assert "data: [DONE]" in lines and not [line for line in lines if '"error"' in line]
    [row] = synced(ctl).services.read_model.list_jobs()
    node_id = row["nodes"][0]
    await wait_for(lambda: codes(ctl, node_id)[-1] == "NODE_STOPPED")
    assert ctl.services.app.get_job(row["job_id"]).state == "COMPLETED"
    stopped = _last_event(ctl, node_id)
    assert (stopped.reason, stopped.lost_jobs) == ("drained (1 job(s) finished)", [])
    assert "NODE_STOPPING" in codes(ctl, node_id)
