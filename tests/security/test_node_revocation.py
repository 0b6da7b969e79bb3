"""Revoking a node: NODE_REVOKED is recorded, its credential stops working at once, its stream
is closed, its running job fails and its client hears so, and it is refused from then on:
through the admin API (the agent session then stops for good) and through `dacp nodes revoke`
written straight to the store (every controller reacts to the event)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import grpc
import httpx
import pytest

from agent.agent_config import AgentConfig, IdentityRejected
from agent.control_client import AgentSession, AgentState
from domain.catalog import code_of
from interfaces.controller_main import RunningController, controller
from tests.conftest import TEST_DATABASE_URL, controller_settings
from tests.faults.streams import SlowWords, stream_completion
from tests.faults.waiting import until
from tests.integration.control_client import RawSession, control_target, enroll
from tests.unit.test_agent_model_store import write_tiny_gguf

ADMIN = {"Authorization": "Bearer test-admin-key"}
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


def _codes(ctl: RunningController, ident: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.events.get(UUID(ident))]


async def test_a_revoked_node_loses_its_job_its_stream_and_its_credential(
    ctl: RunningController, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "m.gguf")
    sha = hashlib.sha256((models / "m.gguf").read_bytes()).hexdigest()
    ctl.services.app.register_model("m", sha, "m.gguf", 2048)
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    config = AgentConfig(
        data_dir=tmp_path / "agent",
        models_dir=models,
        node_name="stolen",
        controller_url=f"127.0.0.1:{ctl.grpc_port}",
        enrollment_token=token,
        heartbeat_interval=0.2,
        backoff_initial=0.05,
        backoff_max=0.2,
    )
    handler = SlowWords(words=400, delay=0.02)
    session = AgentSession(config, handler)
    run = asyncio.create_task(session.run())
    await session.wait_for_state(AgentState.READY, timeout=20)
    node_id = str(session.node_id)
    await until(lambda: len(ctl.services.read_model.eligibility()) == 1, 10)
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
    env = {**os.environ, "DATABASE_URL": f"{TEST_DATABASE_URL}?schema={pg_schema}"}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "interfaces.cli", "nodes", "revoke", "cli-revoked"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
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
