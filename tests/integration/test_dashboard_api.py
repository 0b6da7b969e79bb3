"""The dashboard's admin endpoints on a real controller (Postgres, Redis, gRPC) with FakeAgent
nodes: the metrics history its charts read, and the agent setup its "Add a node" shows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from interfaces.controller_main import RunningController, controller
from interfaces.http.admin.operations_api import agent_controller_url
from tests.conftest import controller_settings
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token, wait_for
from tests.integration.test_job_flow import ADMIN, AI, SHA, chat_once, http, register

pytestmark = pytest.mark.timeout(120)

HISTORY = "/api/admin/metrics/history"


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(pg_schema, tmp_path, metrics_history_interval=0.1)
    async with controller(settings) as running:
        yield running


async def history(client: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    r = await client.get(HISTORY, headers=ADMIN, params=params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def sampled(
    client: httpx.AsyncClient, wanted: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> dict[str, Any]:
    """The first sample ``wanted`` picks, once the controller has taken one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found: list[dict[str, Any]] = [s for s in (await history(client))["data"] if wanted(s)]
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError("no such sample in time")


async def test_the_history_samples_tokens_first_tokens_and_nodes(ctl: RunningController) -> None:
    agent = await FakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30, slots=2
    ).start()
    read = ctl.services.read_model
    await wait_for(lambda: (read.get_node(agent.node_id) or {}).get("state") == "READY")
    async with http(ctl) as client:
        await register(ctl, client)
        r = await chat_once(client, "hi")
        assert r.status_code == 200, r.text
        tokens = await sampled(client, lambda s: s["tokens_per_second"] > 0)
        assert tokens["tokens_per_second"] > 0
        first = await sampled(client, lambda s: s["ttft_p50_ms"] is not None)
        assert 0 < first["ttft_p50_ms"] <= first["ttft_p95_ms"]
        body = await history(client)
        assert body["object"] == "list"
        assert (body["interval_seconds"], body["points"]) == (0.1, 360)
        latest = body["data"][-1]
        assert latest["queue_depth"] == 0
        (node,) = latest["nodes"]
        assert (node["node_id"], node["name"], node["slots"]) == (agent.node_id, "alpha", 2)
        assert node["busy_slots"] == 0 and node["cpu_percent"] == 5.0
        # Only what is newer than a time: the dashboard's polls.
        newer = (await history(client, since=latest["time"]))["data"]
        assert all(s["time"] > latest["time"] for s in newer)
        assert (await history(client, since=latest["time"] + 3600))["data"] == []

        refused = await client.get(HISTORY, params={"since": -1}, headers=ADMIN)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "since"
        assert (await client.get(HISTORY)).status_code == 401
        assert (await client.get(HISTORY, headers=AI)).status_code in (401, 403)
    await agent.stop()


async def test_agent_setup_names_the_control_channel(ctl: RunningController) -> None:
    async with http(ctl) as client:
        r = await client.get("/api/admin/agent-setup", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "controller_url": f"127.0.0.1:{ctl.grpc_port}",
            "tls": True,
            "loopback_only": True,
            "enrollment_enabled": True,
        }
        assert (await client.get("/api/admin/agent-setup")).status_code == 401


def test_a_wildcard_listener_is_dialled_where_the_operator_reached_it() -> None:
    assert agent_controller_url("10.0.0.5", 50051, "ctl.lan") == "10.0.0.5:50051"
    assert agent_controller_url("0.0.0.0", 50051, "ctl.lan") == "ctl.lan:50051"
    assert agent_controller_url("::", 7000, "[fd00::1]") == "[fd00::1]:7000"
    assert agent_controller_url("fd00::2", 7000, "ctl.lan") == "[fd00::2]:7000"
    assert agent_controller_url("", 50051, "") == "127.0.0.1:50051"
