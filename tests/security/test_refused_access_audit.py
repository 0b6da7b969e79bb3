"""Refused enrollments and control streams are audited where an operator looks: the admin API
(`/api/admin/access-refusals`, which the dashboard's event feed also carries as
ACCESS_REFUSED) and `dacp diagnose NAME`, even for a node that never got in."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import httpx
import pytest

from interfaces.controller_main import RunningController
from tests.faults.waiting import until
from tests.integration.control_client import RawSession, control_target, enroll
from tests.security.conftest import dacp

ADMIN = {"Authorization": "Bearer test-admin-key"}
REPO = Path(__file__).resolve().parents[2]


async def test_a_refused_enrollment_is_listed_and_diagnosed(
    ctl: RunningController, pg_schema: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError):
        await enroll(control_target(ctl), "dacp1.forged.token", "intruder")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:

        async def listed() -> list[dict[str, object]]:
            r = await client.get("/api/admin/access-refusals", headers=ADMIN)
            assert r.status_code == 200, r.text
            return list(r.json()["data"])

        deadline = time.monotonic() + 10
        while not (rows := await listed()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        [row] = rows
        assert (row["kind"], row["node_name"], row["source"]) == ("enroll", "intruder", "127.0.0.1")
        assert "enrollment token" in str(row["reason"]) and row["security_violation"] is False
        unauthorised = await client.get("/api/admin/access-refusals")
        assert unauthorised.status_code == 401
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        # HTTP key failures are counted, not recorded: still the one refusal above.
        metrics = (await client.get("/metrics")).text
        assert 'dacp_http_auth_failures_total{api="admin",status="401"} 1.0' in metrics
        assert 'dacp_http_auth_failures_total{api="inference",status="401"} 1.0' in metrics
        assert len(await listed()) == 1
    done = await dacp(pg_schema, "diagnose", "intruder")
    assert done.returncode == 2 and "unknown node intruder" in done.stderr
    assert "refused attempts" in done.stdout and "enrollment from 127.0.0.1" in done.stdout


async def test_a_refused_stream_of_a_known_node_is_in_its_diagnosis(
    ctl: RunningController, pg_schema: str
) -> None:
    target = control_target(ctl)
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    enrolled = await enroll(target, token, "known")
    stolen = RawSession(target, enrolled.node_id, "a-guessed-credential")
    with pytest.raises(grpc.aio.AioRpcError):
        await stolen.open()
    await until(lambda: ctl.services.read_model.list_refusals(node_id=enrolled.node_id), 10)
    done = await dacp(pg_schema, "diagnose", "known")
    assert done.returncode == 0, done.stderr
    assert "control stream from 127.0.0.1" in done.stdout
    assert "wrong credential" in done.stdout
