"""PostgreSQL stopped or frozen. Stopped: new requests fail fast with 503 and ``Retry-After``
(not queued, not hanging). Stopped or frozen: heartbeats are still handled, nodes that kept
heartbeating are not recorded as silent afterwards, and everything works again without a
restart.

A controller on a private PostgreSQL cluster (``initdb`` + ``pg_ctl``) and the shared Redis;
fake agents heartbeat every 0.2 s and the test settings mark a node OFFLINE after 2 s of
silence, so an outage of twice that is long enough for a wrong verdict to show.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from uuid import uuid4

import pytest

from application.store_guard import StoreUnavailable
from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.faults.services import OwnPostgres
from tests.faults.streams import ask, http_client, node_codes, node_state, serving_model_m
from tests.faults.waiting import until
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token

SHA = "ab" * 32
SILENCE = {"HEARTBEAT_TIMEOUT", "NODE_OFFLINE"}
OFFLINE_AFTER = 2.0
#: A request while the store is down must be answered within this (fail fast).
FAST = 3.0
#: Requests succeed again at most this long after the store is back.
RECOVERY = 5.0


ctl = controller_fixture(own="postgres", offline_after=OFFLINE_AFTER, queue_timeout=30.0)


@pytest.fixture
async def agent(ctl: RunningController) -> AsyncIterator[FakeAgent]:
    target = control_target(ctl)
    started = await FakeAgent(target, token(), "a", holds=SHA, memory=4 << 30).start()
    await serving_model_m(ctl, started)
    yield started
    await started.stop()


async def _outage_answers(ctl: RunningController) -> None:
    """What a client sees while the store is away: a quick 503 with Retry-After."""
    started = time.monotonic()
    r = await ask(ctl)
    took = time.monotonic() - started
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after"), r.headers
    assert r.json()["error"]["code"] == "store_unavailable", r.text
    assert took < FAST, f"took {took:.1f}s"
    assert ctl.jobs.queue.depths() in ({}, {"m": 0})  # nothing queued
    async with http_client(ctl) as client:
        started = time.monotonic()
        health = await client.get("/health")
        assert time.monotonic() - started < FAST
    assert health.status_code == 503
    assert health.json()["status"] == "degraded" and health.json()["store"] is False


async def _recovered(ctl: RunningController, agent: FakeAgent, back_at: float) -> float:
    """Works again without a restart, and nobody was recorded as silent; returns how long
    after the store was back the first request succeeded."""
    while True:
        r = await ask(ctl)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert time.monotonic() - back_at < RECOVERY, f"not recovered after {RECOVERY:g}s"
        await asyncio.sleep(0.1)
    recovery = time.monotonic() - back_at
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    assert node_state(ctl, agent) == "READY"
    assert not SILENCE & set(node_codes(ctl, agent)), node_codes(ctl, agent)
    await until(lambda: not ctl.services.follower.error)  # the views caught up again
    await asyncio.to_thread(ctl.services.follower.wait, ctl.services.app.position(), 5.0)
    async with http_client(ctl) as client:
        health = (await client.get("/health")).json()
    assert health["status"] == "ok" and health["read_model_lag"] == 0, health
    assert health["projection_skipped_events"] == []
    print(f"recovered {recovery:.2f}s after the store was back")
    return recovery


async def test_postgres_down_for_twice_offline_after(
    ctl: RunningController, agent: FakeAgent, own_postgres: OwnPostgres
) -> None:
    assert (await ask(ctl)).status_code == 200
    own_postgres.stop()
    down_at = time.monotonic()
    await _outage_answers(ctl)
    await asyncio.sleep(max(0.0, 2 * OFFLINE_AFTER - (time.monotonic() - down_at)))
    await _outage_answers(ctl)
    own_postgres.start()
    await _recovered(ctl, agent, time.monotonic())


async def test_the_first_command_after_the_store_stopped_fails_within_the_pool_wait(
    ctl: RunningController, own_postgres: OwnPostgres
) -> None:
    """Nothing else has noticed the outage (the follower is stopped, no view is read): the
    command's own failure to get a connection trips the guard and answers, within one pool
    wait, not after eventsourcing's ten attempts of it (about 22 s)."""
    ctl.services.follower.stop()
    app = ctl.services.app
    own_postgres.stop()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="the event store is unreachable"):
        await asyncio.to_thread(app.validate_setup, uuid4())
    assert time.monotonic() - started < FAST
    assert not app.guard.up
    with pytest.raises(StoreUnavailable):  # the next one at once, without a pool wait
        await asyncio.wait_for(asyncio.to_thread(app.validate_setup, uuid4()), 0.5)


async def test_postgres_frozen_does_not_block_heartbeats(
    ctl: RunningController, agent: FakeAgent, own_postgres: OwnPostgres
) -> None:
    assert (await ask(ctl)).status_code == 200
    # A job that finishes while the store is frozen: its ending waits for the store, the
    # node's heartbeats must not wait behind it.
    words = tuple(f" w{i}" for i in range(20))
    agent.words, agent.word_delay = words, 0.05
    streaming = asyncio.ensure_future(ask(ctl))
    await until(lambda: len(agent.plans) == 2)
    seen_before = ctl.services.live.get(agent.node_id)
    assert seen_before is not None
    own_postgres.pause()
    try:
        frozen_at = time.monotonic()
        await asyncio.sleep(1.0)
        # Heartbeats keep landing in live state while every store call hangs.
        seen = ctl.services.live.get(agent.node_id)
        assert seen is not None and seen.last_seen > seen_before.last_seen + 0.5
        await asyncio.sleep(max(0.0, 2 * OFFLINE_AFTER - (time.monotonic() - frozen_at)))
        seen = ctl.services.live.get(agent.node_id)
        assert seen is not None and time.time() - seen.last_seen < 1.0
        assert not streaming.done()  # its ending waits for the store
    finally:
        own_postgres.resume()
    answer = await asyncio.wait_for(streaming, RECOVERY)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "".join(words)
    agent.words, agent.word_delay = ("Hello", " world"), 0.0
    await _recovered(ctl, agent, time.monotonic())
