"""Redis flushed, restarted empty, or down: no node that keeps heartbeating is marked
DEGRADED or OFFLINE, and while Redis is down the controller says so (warning and metric).

A controller on the shared PostgreSQL (own schema) and a private ``redis-server``; three
fake agents heartbeat every 0.2 s; the test settings mark a node DEGRADED after 1 s and
OFFLINE after 2 s of silence, so each outage lasts several of those windows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.faults.services import OwnRedis
from tests.faults.streams import node_codes, node_state
from tests.faults.waiting import until
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token

#: Node events that mean the controller thought a node went quiet.
SILENCE = {"HEARTBEAT_TIMEOUT", "NODE_OFFLINE"}
OFFLINE_AFTER = 2.0


ctl = controller_fixture(own="redis", offline_after=OFFLINE_AFTER)


@pytest.fixture
async def fleet(ctl: RunningController) -> AsyncIterator[list[FakeAgent]]:
    target = control_target(ctl)
    agents = [await FakeAgent(target, token(), f"n{i}").start() for i in range(3)]
    await until(lambda: all(node_state(ctl, a) == "READY" for a in agents))
    yield agents
    for agent in agents:
        await agent.stop()


async def _local_only_metric(ctl: RunningController) -> float:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:
        text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("dacp_live_state_local_only "):
            return float(line.split()[1])
    raise AssertionError("dacp_live_state_local_only missing from /metrics")


def _in_redis(own_redis: OwnRedis, agents: list[FakeAgent]) -> bool:
    keys = {k.decode() if isinstance(k, bytes) else k for k in own_redis.client().keys("*node:*")}
    return all(any(a.node_id in k for k in keys) for a in agents)


async def _quiet_period(ctl: RunningController, agents: list[FakeAgent]) -> None:
    """Several OFFLINE_AFTER windows with the sweep running; nobody may look silent."""
    await asyncio.sleep(2.5 * OFFLINE_AFTER)
    for agent in agents:
        assert not SILENCE & set(node_codes(ctl, agent)), node_codes(ctl, agent)
        assert node_state(ctl, agent) == "READY"


async def test_redis_flushed(
    ctl: RunningController, fleet: list[FakeAgent], own_redis: OwnRedis
) -> None:
    await until(lambda: _in_redis(own_redis, fleet))
    own_redis.client().flushall()
    await _quiet_period(ctl, fleet)
    assert _in_redis(own_redis, fleet)  # written again from this controller's own view


async def test_redis_restarted_empty(
    ctl: RunningController, fleet: list[FakeAgent], own_redis: OwnRedis
) -> None:
    await until(lambda: _in_redis(own_redis, fleet))
    own_redis.stop()
    own_redis.start()  # same port, nothing kept
    await _quiet_period(ctl, fleet)
    await until(lambda: _in_redis(own_redis, fleet))


async def test_redis_down_for_several_offline_windows(
    ctl: RunningController,
    fleet: list[FakeAgent],
    own_redis: OwnRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert await _local_only_metric(ctl) == 0
    caplog.set_level(logging.WARNING, logger="infrastructure.live_state")
    own_redis.stop()
    await until(lambda: ctl.services.live.local_only())
    assert await _local_only_metric(ctl) == 1
    assert any("Redis unavailable" in r.getMessage() for r in caplog.records)
    await _quiet_period(ctl, fleet)
    own_redis.start()
    await until(lambda: not ctl.services.live.local_only())
    assert await _local_only_metric(ctl) == 0
    await until(lambda: _in_redis(own_redis, fleet))
    for agent in fleet:
        assert not SILENCE & set(node_codes(ctl, agent))
