"""The real node agent (AgentSession) against the real controller (Postgres, Redis, gRPC)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler, Send
from domain.catalog import code_of
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings


class RecordingHandler(NullHandler):
    """NullHandler that remembers the drain and resume commands it received."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    async def on_drain(self, send: Send) -> None:
        self.commands.append("drain")

    async def on_resume(self, send: Send) -> None:
        self.commands.append("resume")


class FakeRunningJobs(NullHandler):
    """NullHandler that reports running jobs (the test ends them)."""

    def __init__(self, jobs: list[str]) -> None:
        self.jobs = jobs

    def active_job_ids(self) -> list[str]:
        return list(self.jobs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mint(ctl: RunningController) -> str:
    return ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token


def agent_config(
    data_dir: Path,
    grpc_port: int,
    token: str | None,
    *,
    name: str = "real-agent",
    backoff: tuple[float, float] = (0.2, 1.0),
) -> AgentConfig:
    """An agent of the local controller at ``grpc_port``: quick heartbeats, and reconnects
    after ``backoff`` (the first wait, the longest)."""
    return AgentConfig(
        data_dir=data_dir,
        node_name=name,
        controller_url=f"127.0.0.1:{grpc_port}",
        enrollment_token=token,
        heartbeat_interval=0.2,
        backoff_initial=backoff[0],
        backoff_max=backoff[1],
    )


async def run_session(session: AgentSession) -> asyncio.Task[None]:
    task = asyncio.create_task(session.run())
    return task


async def ready_node(
    ctl: RunningController, session: AgentSession
) -> tuple[asyncio.Task[None], str]:
    """Runs ``session`` until the controller's view shows its node READY: its task, node id."""
    task = await run_session(session)
    await session.wait_for_state(AgentState.READY, timeout=15)
    node_id = session.node_id
    assert node_id is not None
    read = ctl.services.read_model
    await eventually(lambda: (read.get_node(node_id) or {}).get("state") == "READY")
    return task, node_id


def node_codes(ctl: RunningController, node_id: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.repository.event_store.get(UUID(node_id))]


async def eventually(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


async def test_agent_restart_recovers_without_enrolling_again(
    ctl: RunningController, tmp_path: Path
) -> None:
    data_dir = tmp_path / "agent"
    first = AgentSession(agent_config(data_dir, ctl.grpc_port, mint(ctl)), RecordingHandler())
    task, node_id = await ready_node(ctl, first)
    read = ctl.services.read_model
    await first.stop()
    await task
    await eventually(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]

    # Restart: no token this time; the stored identity must be enough.
    second = AgentSession(agent_config(data_dir, ctl.grpc_port, None), RecordingHandler())
    task = await run_session(second)
    await second.wait_for_state(AgentState.READY, timeout=15)
    assert second.node_id == node_id
    await eventually(lambda: read.get_node(node_id)["state"] == "READY")  # type: ignore[index]
    codes = node_codes(ctl, node_id)
    assert codes.count("NODE_ENROLLED") == 1
    assert codes[-2:] == ["NODE_STOPPED", "NODE_RECOVERED"]  # it said goodbye: no loss
    await second.stop()
    await task


async def test_a_signal_drains_the_real_agent_then_it_stops_cleanly(
    ctl: RunningController, tmp_path: Path
) -> None:
    """The real session and controller: a stop signal sends Stopping (NODE_STOPPING, the node
    DRAINING), then, no job running, Goodbye (NODE_STOPPED, nothing lost)."""
    handler = FakeRunningJobs(["j1", "j2"])
    session = AgentSession(agent_config(tmp_path / "agent", ctl.grpc_port, mint(ctl)), handler)
    task, node_id = await ready_node(ctl, session)
    read = ctl.services.read_model
    session.on_signal(signal.SIGTERM)  # its two jobs still run
    await eventually(lambda: read.get_node(node_id)["state"] == "DRAINING")  # type: ignore[index]
    assert node_codes(ctl, node_id)[-1] == "NODE_STOPPING"
    handler.jobs = []
    await asyncio.wait_for(task, 15)
    assert session.exit_code == 0
    await eventually(lambda: read.get_node(node_id)["state"] == "OFFLINE")  # type: ignore[index]
    events = list(ctl.services.app.repository.event_store.get(UUID(node_id)))
    assert [code_of(e) for e in events][-2:] == ["NODE_STOPPING", "NODE_STOPPED"]
    stopped: Any = events[-1]
    assert (stopped.reason, stopped.lost_jobs) == ("drained (2 job(s) finished)", [])


async def test_agent_backs_off_until_the_controller_appears(pg_schema: str, tmp_path: Path) -> None:
    port = free_port()
    settings = controller_settings(pg_schema, tmp_path, grpc_port=port)
    # The token must be signed with the controller's secret and name its CA; mint it before
    # the controller runs, as `dacp token create` does (which makes the CA the controller
    # then serves with).
    from application.enrollment import enrollment_key, mint_enrollment_token
    from infrastructure.tls import fingerprint_of, pinned_ca

    token = mint_enrollment_token(
        enrollment_key(settings.node_enrollment_secret),
        ttl_seconds=60,
        single_use=False,
        node_name=None,
        now=time.time(),
        ca_fingerprint=fingerprint_of(pinned_ca(settings.tls_dir)),
    ).token
    session = AgentSession(agent_config(tmp_path / "agent", port, token), RecordingHandler())
    task = await run_session(session)
    deadline = time.monotonic() + 15
    while session.failed_attempts < 3:
        assert time.monotonic() < deadline, "the agent did not retry"
        await asyncio.sleep(0.05)
    assert session.state == AgentState.REGISTERING
    async with controller(settings) as ctl:
        await session.wait_for_state(AgentState.READY, timeout=15)
        node_id = session.node_id
        assert node_id is not None
        assert node_codes(ctl, node_id)[:2] == ["NODE_ENROLLED", "NODE_READY"]
        await session.stop()
        await task


async def test_drain_and_resume_reach_the_agent(ctl: RunningController, tmp_path: Path) -> None:
    handler = RecordingHandler()
    session = AgentSession(agent_config(tmp_path / "agent", ctl.grpc_port, mint(ctl)), handler)
    task = await run_session(session)
    await session.wait_for_state(AgentState.READY, timeout=15)
    node_id = session.node_id
    read = ctl.services.read_model
    await eventually(lambda: (read.get_node(node_id or "") or {}).get("state") == "READY")
    headers = {"Authorization": "Bearer test-admin-key"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:
        drained = await client.post(f"/api/admin/nodes/{node_id}/drain", headers=headers)
        assert drained.json()["state"] == "DRAINING"
        await eventually(lambda: handler.commands == ["drain"])
        await client.post(f"/api/admin/nodes/{node_id}/resume", headers=headers)
        await eventually(lambda: handler.commands == ["drain", "resume"])
    await session.stop()
    await task
