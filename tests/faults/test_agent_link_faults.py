"""An agent's link to the controller cut or black-holed: the agent notices and reconnects
without enrolling again, and the controller notices too, so it neither keeps a dead stream
nor waits for TCP's retransmissions (minutes). A black hole is noticed only through gRPC
keepalive, which both ends now run (``wire/keepalive.py``; 1 s here, 20 s by default).
A link down for 3 s in the middle of a stream costs the client nothing: the job completes
with exactly its text, as the agent re-sends what the controller missed.

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
from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler
from domain.catalog import code_of
from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.faults.streams import (
    SlowWords,
    agent_holding_model,
    events,
    recorded_seqs,
    serves_model,
    stream_completion,
)
from tests.faults.tcp_proxy import TcpProxy
from tests.faults.waiting import until

KEEPALIVE = 1.0  # interval and timeout, both ends
#: A dead link must be noticed within the keepalive interval + timeout, plus slack.
NOTICED_WITHIN = 2 * KEEPALIVE + 3.0


ctl = controller_fixture(
    keepalive_interval=KEEPALIVE,
    keepalive_timeout=KEEPALIVE,
    # Heartbeats must not be what notices: the health sweep stays out of the way.
    degraded_after=30.0,
    offline_after=60.0,
)


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


@pytest.fixture
async def streaming(
    ctl: RunningController, proxy: TcpProxy, tmp_path: Path
) -> AsyncIterator[tuple[AgentSession, SlowWords]]:
    """An agent holding model ``m`` whose jobs stream 160 words 25 ms apart (4 s)."""
    handler = SlowWords(words=160, delay=0.025)
    agent = agent_holding_model(
        ctl,
        tmp_path,
        handler,
        name="streams",
        controller_url=proxy.address,
        backoff_initial=0.1,
        keepalive_interval=KEEPALIVE,
        keepalive_timeout=KEEPALIVE,
    )
    task = asyncio.create_task(agent.run())
    await agent.wait_for_state(AgentState.READY, timeout=15)
    await until(lambda: serves_model(ctl), 10)
    yield agent, handler
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("fault", ["cut", "black hole"])
async def test_a_link_down_for_3_s_mid_stream_costs_the_client_nothing(
    ctl: RunningController,
    proxy: TcpProxy,
    streaming: tuple[AgentSession, SlowWords],
    fault: str,
) -> None:
    agent, handler = streaming
    client = asyncio.create_task(stream_completion(f"http://127.0.0.1:{ctl.http_port}"))
    await until(lambda: handler.sent >= 20, 15)
    connections, failures, accepted = agent.connections, agent.failed_attempts, proxy.accepted
    await proxy.outage(fault, 3.0)
    back = await until(lambda: agent.connections > connections, NOTICED_WITHIN + 2.0)
    # Every retry really connected (the first failure is the stream that broke, the last
    # connection the one that worked): none was refused by gRPC's own reconnect backoff.
    assert proxy.accepted - accepted >= agent.failed_attempts - failures >= 1
    result = await asyncio.wait_for(client, 30)
    assert result["error"] is None, result
    assert result["text"] == handler.text() and result["finish_reason"] == "stop"
    [job] = handler.jobs
    assert code_of(events(ctl, job)[-1]) == "JOB_COMPLETED"
    assert recorded_seqs(ctl, job) == list(range(handler.words))
    node_codes = [code_of(e) for e in events(ctl, str(agent.node_id))]
    assert "NODE_OFFLINE" not in node_codes and node_codes.count("NODE_ENROLLED") == 1
    print(f"{fault} for 3 s: the agent was back {back:.2f}s after the link was; text whole")


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
