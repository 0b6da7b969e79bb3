"""Revoking a node: NODE_REVOKED is recorded, its credential stops working at once, its stream
is closed, its running job fails and its client hears so, and it is refused from then on:
through the admin API (the agent session then stops for good) and through `dacp nodes revoke`
written straight to the store (every controller reacts to the event)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from uuid import UUID

import grpc
import httpx
import pytest

from agent.agent_config import IdentityRejected
from agent.control.control_client import AgentState
from domain.catalog import code_of
from interfaces.controller_main import RunningController
from tests.faults.streams import SlowWords, agent_holding_model, serves_model, stream_completion
from tests.faults.waiting import until
from tests.integration.control_client import RawSession, control_target, enroll
from tests.security.conftest import dacp

ADMIN = {"Authorization": "Bearer test-admin-key"}
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def _codes(ctl: RunningController, ident: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.events.get(UUID(ident))]


async def test_a_revoked_node_loses_its_job_its_stream_and_its_credential(
    ctl: RunningController, tmp_path: Path
) -> None:
    handler = SlowWords(words=400, delay=0.02)
    session = agent_holding_model(ctl, tmp_path, handler, name="stolen", backoff_max=0.2)
    run = asyncio.create_task(session.run())
    await session.wait_for_state(AgentState.READY, timeout=20)
    node_id = str(session.node_id)
    await until(lambda: serves_model(ctl), 10)
    client = asyncio.create_task(stream_completion(f"http://127.0.0.1:{ctl.http_port}"))
    await until(lambda: handler.sent >= 10, 15)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
        r = await http.post(
            f"/api/admin/nodes/{node_id}/revoke", headers=ADMIN, json={"reason": "laptop stolen"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "OFFLINE" and r.json()["revoked"] is True
        again = await http.post(f"/api/admin/nodes/{node_id}/revoke", headers=ADMIN)
        assert again.status_code == 409

    result = await asyncio.wait_for(client, 20)
    assert result["error"] is not None and result["error"]["code"] == "node_lost", result
    [job] = handler.jobs
    assert _codes(ctl, job)[-1] == "JOB_FAILED"
    # The agent's next Connect is refused with its credential: it stops for good.
    with pytest.raises(IdentityRejected):
        await asyncio.wait_for(run, 20)
    codes = _codes(ctl, node_id)
    assert "NODE_REVOKED" in codes and "NODE_RECOVERED" not in codes[codes.index("NODE_REVOKED") :]
    assert ctl.services.app.get_node(node_id).state == "OFFLINE"


async def test_dacp_nodes_revoke_closes_the_stream_of_a_running_controller(
    ctl: RunningController, pg_schema: str
) -> None:
    target = control_target(ctl)
    enrolled = await enroll(
        target,
        ctl.services.enrollment.mint(
            ttl_seconds=60, single_use=True, node_name=None, now=time.time()
        ).token,
        "cli-revoked",
    )
    session = RawSession(target, enrolled.node_id, enrolled.node_credential)
    await session.open()
    session.start_heartbeats(0.2)
    await until(lambda: ctl.services.connections.is_connected(enrolled.node_id), 10)
    done = await dacp(pg_schema, "nodes", "revoke", "--store", "cli-revoked")
    assert done.returncode == 0, done.stderr
    assert "revoked node cli-revoked" in done.stdout
    took = await until(lambda: not ctl.services.connections.is_connected(enrolled.node_id), 10)
    again = RawSession(target, enrolled.node_id, enrolled.node_credential)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await again.open()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in (refused.value.details() or "")
    await session.drop()
    print(f"the controller closed the revoked node's stream {took:.2f}s after the CLI wrote it")


async def test_every_file_server_learns_a_revocation_at_once(ctl: RunningController) -> None:
    """A revoked node may still hold a ticket (five minutes) and a certificate (30 days): the
    agents connected now hear NodesRevoked, one connecting later finds it in its Welcome, and
    the controller's own store server refuses it too."""
    target = control_target(ctl)

    async def connected(name: str) -> tuple[str, RawSession]:
        token = ctl.services.enrollment.mint(
            ttl_seconds=60, single_use=True, node_name=None, now=time.time()
        ).token
        enrolled = await enroll(target, token, name)
        session = RawSession(target, enrolled.node_id, enrolled.node_credential)
        await session.open()
        session.start_heartbeats(0.2)
        await until(lambda: ctl.services.connections.is_connected(enrolled.node_id), 10)
        return enrolled.node_id, session

    thief, thief_session = await connected("thief")
    _, witness = await connected("witness")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
        revoked = await http.post(f"/api/admin/nodes/{thief}/revoke", headers=ADMIN)
        assert revoked.status_code == 200, revoked.text

    def told() -> bool:
        return any(
            m.WhichOneof("payload") == "nodes_revoked" and thief in m.nodes_revoked.node_ids
            for m in witness.received
        )

    await until(told, 10)
    assert ctl.store_server is not None and thief in ctl.store_server.revoked
    _, late = await connected("late")
    assert thief in late.received[0].welcome.revoked_node_ids
    for session in (thief_session, witness, late):
        await session.drop()
