"""The agent across a lost control stream (against :class:`FakeControlPlane`): what a job
sends meanwhile is journalled and re-sent from where the controller's Welcome says it lacks
tokens; jobs the controller no longer waits for are cancelled; a job the controller waits for
that this agent does not run is reported lost; a stopping agent says goodbye."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler, Send
from agent.runtime.job_messages import JOB_LOST
from tests.integration.fake_control_plane import (
    FakeControlPlane,
    FakeStream,
    eventually,
    make_config,
    running,
    start_server,
)
from wire import control_pb2 as pb

pytestmark = pytest.mark.timeout(30)


class Streaming(NullHandler):
    """Leads jobs whose tokens the test releases (``emit``); records cancels."""

    def __init__(self) -> None:
        self.send: Send | None = None
        self.next_seq: dict[str, int] = {}
        self.running: set[str] = set()
        self.cancelled: list[str] = []

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        self.send = send
        self.next_seq[plan.job_id] = 0
        self.running.add(plan.job_id)
        await send(pb.AgentMessage(setup_result=pb.SetupResult(job_id=plan.job_id, ok=True)))

    async def emit(self, job_id: str, count: int) -> None:
        assert self.send is not None
        for _ in range(count):
            seq = self.next_seq[job_id]
            self.next_seq[job_id] = seq + 1
            delta = pb.Delta(seq=seq, text=f" w{seq}", tokens=1)
            await self.send(
                pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job_id, deltas=[delta]))
            )

    async def finish(self, job_id: str) -> None:
        assert self.send is not None
        self.running.discard(job_id)
        done = pb.JobResult(job_id=job_id, ok=True, finish_reason="stop")
        await self.send(pb.AgentMessage(job_result=done))

    async def on_cancel(self, msg: pb.CancelJob, send: Send) -> None:
        self.cancelled.append(msg.job_id)
        self.running.discard(msg.job_id)

    def active_job_ids(self) -> list[str]:
        return sorted(self.running)


def received(stream: FakeStream, job_id: str) -> list[int | str]:
    """The token sequence numbers and results the fake controller got for ``job_id``."""
    out: list[int | str] = []
    for _, message in stream.received:
        kind = message.WhichOneof("payload")
        if kind == "token_chunk" and message.token_chunk.job_id == job_id:
            out.extend(d.seq for d in message.token_chunk.deltas)
        elif kind == "job_result" and message.job_result.job_id == job_id:
            out.append(message.job_result.error_code or "result")
    return out


async def _plan(stream: FakeStream, job_id: str) -> None:
    plan = pb.ExecutionPlan(job_id=job_id, role=pb.ExecutionPlan.PRIMARY)
    stream.outbound.put_nowait(pb.ControllerMessage(execution_plan=plan))


async def test_what_a_job_sent_while_disconnected_is_resent_from_the_missing_token(
    tmp_path: Path, fake: FakeControlPlane
) -> None:
    server, port = await start_server(fake)
    handler = Streaming()
    session = AgentSession(make_config(tmp_path, f"127.0.0.1:{port}"), handler)
    try:
        async with running(session):
            await session.wait_for_state(AgentState.READY, timeout=10)
            await _plan(fake.streams[0], "j")
            await eventually(lambda: "j" in handler.running)
            await handler.emit("j", 5)
            await eventually(lambda: received(fake.streams[0], "j") == [0, 1, 2, 3, 4])
            await server.stop(None)  # the controller is gone ...
            await session.wait_for_state(AgentState.REGISTERING, timeout=5)
            await handler.emit("j", 3)  # ... while the job goes on: tokens 5-7
            # It comes back having received only tokens 0-2 (3 and 4 died in flight).
            fake.resumed = {"j": 3}
            server, _ = await start_server(fake, port)
            await session.wait_for_state(AgentState.READY, timeout=10)
            await handler.emit("j", 2)
            await handler.finish("j")
            again = fake.streams[1]
            await eventually(lambda: "result" in received(again, "j"))
            assert received(again, "j") == [3, 4, 5, 6, 7, 8, 9, "result"]
            assert handler.cancelled == []
    finally:
        await server.stop(None)


async def test_jobs_the_controller_gave_up_are_cancelled_and_unknown_ones_reported(
    tmp_path: Path, fake: FakeControlPlane
) -> None:
    handler = Streaming()
    server, port = await start_server(fake)
    session = AgentSession(make_config(tmp_path, f"127.0.0.1:{port}"), handler)
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        await _plan(fake.streams[0], "given-up")
        await eventually(lambda: "given-up" in handler.running)
        await handler.emit("given-up", 2)
        fake.resumed = {"never-ran-here": 0}  # the controller restarted, say
        fake.streams[0].outbound.put_nowait(grpc.StatusCode.UNAVAILABLE)
        await eventually(lambda: len(fake.streams) == 2 and bool(fake.streams[1].received))
        await eventually(lambda: handler.cancelled == ["given-up"])
        again = fake.streams[1]
        await eventually(lambda: received(again, "never-ran-here") == [JOB_LOST])
        assert received(again, "given-up") == []  # nothing re-sent: it was given up
        assert session.traffic.journal.jobs() == []
    await server.stop(None)


@asynccontextmanager
async def ready_session(tmp_path: Path, controller_url: str) -> AsyncIterator[AgentSession]:
    """A session whose handler takes no job, running and READY (stopped on leaving)."""
    session = AgentSession(make_config(tmp_path, controller_url), NullHandler())
    async with running(session):
        await session.wait_for_state(AgentState.READY, timeout=10)
        yield session


async def test_a_stopping_agent_says_goodbye(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    async with ready_session(tmp_path, controller_url):
        assert not fake.streams[0].said_goodbye  # only once it stops
    assert fake.streams[0].said_goodbye


async def test_a_broken_stream_is_not_a_goodbye(
    tmp_path: Path, fake: FakeControlPlane, controller_url: str
) -> None:
    async with ready_session(tmp_path, controller_url):
        fake.streams[0].outbound.put_nowait(grpc.StatusCode.UNAVAILABLE)
        await eventually(lambda: len(fake.streams) == 2)
        assert not fake.streams[0].said_goodbye
