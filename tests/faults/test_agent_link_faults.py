"""An agent's link to the controller cut or black-holed: the agent notices and reconnects
without enrolling again, and the controller notices too, so it neither keeps a dead stream
nor waits for TCP's retransmissions (minutes). A black hole is noticed only through gRPC
keepalive, which both ends now run (``proto/keepalive.py``; 1 s here, 20 s by default).

The real agent session (``AgentSession``, no llama.cpp) talks to the real controller through
a TCP proxy that cuts or silences its connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import pytest

from agent.agent_config import AgentConfig
from agent.control_client import AgentSession, AgentState
from agent.control_handler import NullHandler
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.faults.tcp_proxy import TcpProxy
from tests.faults.waiting import until

KEEPALIVE = 1.0  # interval and timeout, both ends
#: A dead link must be noticed within the keepalive interval + timeout, plus slack.
NOTICED_WITHIN = 2 * KEEPALIVE + 3.0


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(
        pg_schema,
        tmp_path,
        keepalive_interval=KEEPALIVE,
        keepalive_timeout=KEEPALIVE,
        # Heartbeats must not be what notices: the health sweep stays out of the way.
        degraded_after=30.0,
        offline_after=60.0,
    )
    async with controller(settings) as running:
        yield running


@pytest.fixture
async def proxy(ctl: RunningController) -> AsyncIterator[TcpProxy]:
    server = await TcpProxy("127.0.0.1", ctl.grpc_port).start()
    yield server
    await server.close()


@pytest.fixture
async def session(
    ctl: RunningController, proxy: TcpProxy, tmp_path: Path
) -> AsyncIterator[AgentSession]:
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    config = AgentConfig(
        data_dir=tmp_path / "agent",
        node_name="linked",
        controller_url=proxy.address,
        enrollment_token=token,
        heartbeat_interval=0.2,
        backoff_initial=0.1,
        backoff_max=0.5,
        keepalive_interval=KEEPALIVE,
        keepalive_timeout=KEEPALIVE,
    )
    agent = AgentSession(config, NullHandler())
    task = asyncio.create_task(agent.run())
    await agent.wait_for_state(AgentState.READY, timeout=15)
    yield agent
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("fault", ["cut", "black hole"])
async def test_a_dead_link_is_noticed_and_the_agent_reconnects(
    ctl: RunningController, proxy: TcpProxy, session: AgentSession, fault: str
) -> None:
    node_id = session.node_id
    assert node_id and ctl.services.connections.is_connected(node_id)
    enrolled = len(list(ctl.services.app.repository.event_store.get(UUID(node_id))))
    connections = session.connections
    (proxy.cut if fault == "cut" else proxy.black_hole)()
    took = await until(
        lambda: session.connections > connections and session.state == AgentState.READY,
        NOTICED_WITHIN,
    )
    await until(lambda: ctl.services.connections.is_connected(node_id), NOTICED_WITHIN)
    assert session.node_id == node_id  # the same identity: no second enrolment
    events = ctl.services.app.repository.event_store.get(UUID(node_id))
    assert "NODE_ENROLLED" not in [type(e).__name__ for e in list(events)[enrolled:]]
    print(f"{fault}: the agent was back {took:.2f}s after the fault")
