"""Metrics and the live event feed on a real controller (Postgres, Redis, gRPC), with a
FakeAgent standing in for llama.cpp."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from interfaces.controller_main import RunningController, controller
from interfaces.http.admin.event_feed import EventFeed
from tests.conftest import controller_settings
from tests.integration.test_control_plane import ready_node, wait_for
from tests.integration.test_job_flow import ADMIN, SHA, agents, chat_once, http, register

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(pg_schema, tmp_path, rpc_worker_timeout=1.0, setup_timeout=2.0)
    async with controller(settings) as running:
        yield running


async def scrape(client: httpx.AsyncClient, path: str = "/metrics", **kwargs: Any) -> Samples:
    r = await client.get(path, **kwargs)  # /metrics needs no key: Prometheus scrapes it as is
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples.get((metric, tuple(sorted(labels.items()))), 0.0)


async def scrape_until(
    client: httpx.AsyncClient, ok: Callable[[Samples], bool], timeout: float = 10.0
) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(client)
        if ok(samples):
            return samples
        assert time.monotonic() < deadline, "metrics did not move in time"
        await asyncio.sleep(0.1)


class Sse:
    """Reads one server-sent-event stream in a background task: ``(event, data)`` pairs in
    :attr:`items` (``None`` once the stream ends), comments in :attr:`comments`."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.items: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self.comments: list[str] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        event, data = "message", []
        try:
            async for line in self.response.aiter_lines():
                if line.startswith(":"):
                    self.comments.append(line[1:].strip())
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    await self.items.put((event, orjson.loads("\n".join(data))))
                    event, data = "message", []
        finally:
            await self.items.put(None)

    async def next(self, timeout: float = 10.0) -> tuple[str, Any]:
        item = await asyncio.wait_for(self.items.get(), timeout)
        if item is None:
            raise EOFError("the stream ended")
        return item

    async def until(self, match: Callable[[str, Any], bool], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            event, data = await self.next(max(0.1, deadline - time.monotonic()))
            if match(event, data):
                return data


@asynccontextmanager
async def feed(
    client: httpx.AsyncClient, **kwargs: Any
) -> AsyncIterator[tuple[httpx.Response, Sse]]:
    async with client.stream("GET", "/api/admin/events/stream", **kwargs) as response:
        stream = Sse(response)
        try:
            yield response, stream
        finally:
            stream.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await stream.task


async def test_metrics_move_with_traffic(ctl: RunningController) -> None:
    async with http(ctl) as client:
        before = await scrape(client)
        (agent,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30})
        await register(ctl, client)
        r = await chat_once(client)
        assert r.status_code == 200, r.text
        after = await scrape_until(
            client,
            lambda s: (
                value(s, "dacp_jobs_finished_total", state="COMPLETED") == 1
                and value(s, "dacp_tokens_generated_total") == 2
            ),
        )
        nodes = await scrape(client, "/metrics/nodes", headers=ADMIN)
    node = {"node_id": agent.node_id, "name": "a"}
    moved = {
        name: (value(before, name), value(after, name))
        for name in (
            "dacp_jobs_submitted_total",
            "dacp_time_to_first_token_seconds_count",
            "dacp_inter_token_latency_seconds_count",
            "dacp_event_store_append_seconds_count",
        )
    }
    assert moved["dacp_jobs_submitted_total"] == (0, 1)
    assert moved["dacp_time_to_first_token_seconds_count"] == (0, 1)
    assert moved["dacp_inter_token_latency_seconds_count"][1] >= 1  # two words, one gap
    assert (
        moved["dacp_event_store_append_seconds_count"][1]
        > moved["dacp_event_store_append_seconds_count"][0]
    )
    assert 0 < value(after, "dacp_time_to_first_token_seconds_sum") < 10
    assert value(before, "dacp_tokens_generated_total") == 0
    assert value(after, "dacp_jobs_finished_total", state="FAILED") == 0
    assert value(after, "dacp_events_applied_total", code="JOB_COMPLETED") == 1
    assert value(after, "dacp_nodes", state="READY") == 1
    assert value(after, "dacp_nodes", state="OFFLINE") == 0
    assert value(after, "dacp_nodes_connected") == 1
    # The per-node gauges need the admin key (/metrics names no node).
    assert agent.node_id not in str(after)
    assert value(nodes, "dacp_node_connected", **node) == 1
    assert 0 <= value(nodes, "dacp_node_heartbeat_age_seconds", **node) < 5
    assert value(after, "dacp_jobs_active") == 0
    assert value(after, "dacp_read_model_position") > value(before, "dacp_read_model_position")
    assert value(after, "dacp_scrape_errors_total") == 0
    await agent.stop()


async def test_feed_delivers_a_drain_as_it_happens(ctl: RunningController) -> None:
    node_id, session = await ready_node(ctl)
    async with http(ctl) as client, feed(client, headers=ADMIN) as (response, stream):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        event, ready = await stream.next()
        assert event == "ready" and ready["position"] >= 1
        r = await client.post(f"/api/admin/nodes/{node_id}/drain", headers=ADMIN)
        assert r.status_code == 202, r.text
        drained = await stream.until(
            lambda e, d: e == "message" and d["code"] == "NODE_DRAIN_REQUESTED"
        )
        assert drained["aggregate_id"] == node_id
        assert drained["kind"] == "node" and drained["state"] == "DRAINING"
        assert drained["position"] > ready["position"] and drained["time"]
        assert "admin-api" in drained["summary"]
        nxt = await stream.until(lambda e, d: e == "message")
        assert nxt["code"] == "NODE_DRAINED" and nxt["position"] > drained["position"]
    # the client went away: its queue goes with it
    live_feed = ctl.feed
    await wait_for(lambda: live_feed.subscriber_count == 0)
    await session.close()


async def test_feed_accepts_a_ticket_and_keeps_idle_streams_alive(
    ctl: RunningController,
) -> None:
    live_feed = ctl.feed
    assert isinstance(live_feed, EventFeed)
    live_feed.keepalive_seconds = 0.2
    async with http(ctl) as client:
        minted = await client.post("/api/admin/feed-tickets", headers=ADMIN)
        assert minted.status_code == 201, minted.text
        ticket = minted.json()["ticket"]
        assert "test-admin-key" not in ticket  # what goes in the URL is not the key
    async with (
        http(ctl) as client,
        feed(client, params={"ticket": ticket}) as (response, stream),
    ):
        assert response.status_code == 200
        assert (await stream.next())[0] == "ready"
        await wait_for(lambda: live_feed.subscriber_count == 1)
        with pytest.raises(TimeoutError):
            await stream.next(timeout=0.7)  # nothing happens: only keepalive comments
        assert stream.comments.count("keepalive") >= 2
        samples = await scrape(client)
        assert value(samples, "dacp_event_feed_subscribers") == 1
        live_feed.close()  # what stop_controller does first: open streams end
        with pytest.raises(EOFError):
            await stream.next()
    await wait_for(lambda: live_feed.subscriber_count == 0)


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({}, 401, "missing_api_key"),
        ({"headers": {"Authorization": "Bearer wrong"}}, 403, "invalid_api_key"),
        ({"params": {"access_token": "test-admin-key"}}, 401, "missing_api_key"),  # not any more
        ({"params": {"ticket": "wrong"}}, 401, "invalid_ticket"),
        ({"params": {"ticket": f"{int(time.time()) - 1}.00"}}, 401, "invalid_ticket"),  # expired
    ],
)
async def test_feed_refuses_without_the_admin_key(
    ctl: RunningController, kwargs: dict[str, Any], status: int, code: str
) -> None:
    async with http(ctl) as client:
        r = await client.get("/api/admin/events/stream", **kwargs)
        assert r.status_code == status
        assert r.json()["error"]["code"] == code
        # a ticket is for the feed only: other admin routes still want the header
        ticket = (await client.post("/api/admin/feed-tickets", headers=ADMIN)).json()["ticket"]
        r = await client.get("/api/admin/nodes", params={"ticket": ticket})
        assert r.status_code == 401


async def test_dashboard_page_holds_no_secret(ctl: RunningController) -> None:
    async with http(ctl) as client:
        page = await client.get("/dashboard")
        assert page.status_code == 200
        script = await client.get("/dashboard/static/dashboard.js")
        assert script.status_code == 200
    for body in (page.text, script.text):
        for secret in ("test-admin-key", "test-ai-key", "test-enrollment-secret"):
            assert secret not in body
