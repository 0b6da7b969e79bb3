"""Many clients at once over real HTTP, gRPC, Postgres and Redis, with FakeAgents: the admission
queue, race-free placement, queue timeouts and clients that leave while queued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from domain.catalog import code_of
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_job_flow import AI, SHA, agents, http, register, synced

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(pg_schema, tmp_path, queue_timeout=30.0)
    async with controller(settings) as running:
        yield running


@pytest.fixture
async def started(ctl: RunningController) -> AsyncIterator[list[FakeAgent]]:
    """The test's agents, stopped before its controller (no stream outlives its test)."""
    agents_: list[FakeAgent] = []
    yield agents_
    await asyncio.gather(*(agent.stop() for agent in agents_))


def stored(ctl: RunningController) -> list[tuple[str, str]]:
    """(code, aggregate id) of every event, in store order."""
    app = ctl.services.app
    out = []
    for notification in app.recorder.select_notifications(1, 1_000_000):
        event = app.mapper.to_domain_event(notification)
        out.append((code_of(event), str(event.originator_id)))
    return out


def peak_running(events: list[tuple[str, str]]) -> int:
    """Most jobs dispatched and not yet ended at any point of the store's order."""
    running: set[str] = set()
    peak = 0
    for code, job in events:
        if code == "JOB_DISPATCHED":
            running.add(job)
            peak = max(peak, len(running))
        elif code in ("JOB_COMPLETED", "JOB_FAILED", "JOB_CANCELLED"):
            running.discard(job)
    return peak


async def stream_text(client: httpx.AsyncClient, prompt: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", headers=AI, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return "".join(parts)


def slow_words(count: int) -> tuple[str, ...]:
    return tuple(f" w{i}" for i in range(count))


async def fleet(
    ctl: RunningController, started: list[FakeAgent], size: int, words: int, delay: float
) -> list[FakeAgent]:
    spec: dict[str, Any] = {"holds": SHA, "memory": 4 << 30, "words": slow_words(words)}
    new = await agents(ctl, *({"name": f"n{i:02d}", **spec} for i in range(size)))
    started.extend(new)
    for agent in new:
        agent.word_delay = delay
    return new


async def all_served(
    ctl: RunningController, requests: int
) -> tuple[list[tuple[str, str]], list[str]]:
    """``requests`` streams at once, each given all 40 words and completed; the stored events
    and their codes."""
    async with http(ctl) as client:
        await register(ctl, client)
        texts = await asyncio.gather(*(stream_text(client, f"p{i}") for i in range(requests)))
    assert texts == ["".join(slow_words(40))] * requests
    events = stored(synced(ctl))
    codes = [code for code, _ in events]
    assert codes.count("JOB_COMPLETED") == requests
    return events, codes


async def test_thirty_idle_nodes_serve_thirty_streams_at_once(
    ctl: RunningController, started: list[FakeAgent]
) -> None:
    await fleet(ctl, started, 30, words=40, delay=0.1)
    events, codes = await all_served(ctl, 30)
    assert "JOB_QUEUED" not in codes
    assert "JOB_REPLANNED" not in codes
    assert "JOB_FAILED" not in codes
    assert peak_running(events) == 30


async def test_three_times_oversubscribed_completes_everything_in_queue_order(
    ctl: RunningController, started: list[FakeAgent]
) -> None:
    # Each job streams for ~2 s, far longer than it takes all 12 requests to arrive.
    await fleet(ctl, started, 4, words=40, delay=0.05)
    events, codes = await all_served(ctl, 12)
    assert "JOB_FAILED" not in codes and "JOB_REPLANNED" not in codes
    queued = [job for code, job in events if code == "JOB_QUEUED"]
    assert len(queued) == 8  # 4 slots: 8 of the 12 had to wait
    dispatched = [job for code, job in events if code == "JOB_DISPATCHED"]
    assert [job for job in dispatched if job in set(queued)] == queued
    assert peak_running(events) == 4


async def test_a_queue_timeout_is_503_with_retry_after(pg_schema: str, tmp_path: Path) -> None:
    settings = controller_settings(pg_schema, tmp_path, queue_timeout=0.5)
    started: list[FakeAgent] = []
    async with controller(settings) as ctl:
        await fleet(ctl, started, 1, words=200, delay=0.02)
        async with http(ctl) as client:
            await register(ctl, client)
            busy = asyncio.create_task(stream_text(client, "long"))
            await wait_for_code(ctl, "JOB_DISPATCHED", 1)
            r = await client.post(
                "/v1/chat/completions",
                headers=AI,
                json={"model": "m", "messages": [{"role": "user", "content": "late"}]},
            )
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) > 0
            assert r.json()["error"]["code"] == "queue_timeout"
            busy.cancel()
        codes = [code for code, _ in stored(synced(ctl))]
        assert codes.count("JOB_QUEUED") == 1
        await started[0].stop()


async def test_a_client_that_leaves_while_queued_is_cancelled_and_holds_no_slot(
    ctl: RunningController, started: list[FakeAgent]
) -> None:
    (agent,) = await fleet(ctl, started, 1, words=40, delay=0.02)
    async with http(ctl) as client:
        await register(ctl, client)
        first = asyncio.create_task(stream_text(client, "first"))
        await wait_for_code(ctl, "JOB_DISPATCHED", 1)
        leaver = asyncio.create_task(stream_text(client, "leaves"))
        await wait_for_code(ctl, "JOB_QUEUED", 1)
        leaver.cancel()  # closes the connection before any response header
        with pytest.raises(asyncio.CancelledError):
            await leaver
        await wait_for_code(ctl, "JOB_CANCELLED", 1)
        assert await first == "".join(slow_words(40))
    events = stored(synced(ctl))
    cancelled = next(job for code, job in events if code == "JOB_CANCELLED")
    job_events = [code for code, job in events if job == cancelled]
    assert job_events == ["JOB_SUBMITTED", "JOB_QUEUED", "JOB_CANCELLED"]
    assert len(agent.plans) == 1  # the leaver never reached a node
    row = ctl.services.read_model.get_node(agent.node_id)
    assert row is not None and row["current_jobs"] == []


async def wait_for_code(ctl: RunningController, code: str, count: int) -> None:
    for _ in range(400):
        if [c for c, _ in stored(ctl)].count(code) >= count:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{code} x{count} never recorded")
