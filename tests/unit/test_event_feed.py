"""The live event feed's broadcaster and the Prometheus adapter, without a controller."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from application.feed_tickets import issue_ticket
from application.ports import LiveNode
from domain.access_refusal import AccessRefusal
from infrastructure.metrics import (
    ClusterCollector,
    ClusterSources,
    NodeCollector,
    PrometheusMetrics,
)
from infrastructure.settings import Settings
from interfaces.http.admin.event_feed import (
    EventFeed,
    FeedClosed,
    Gap,
    encode,
    feed_authorization,
    feed_message,
    sse_stream,
)
from tests.unit.domain_builders import job_in, ready_node


def message(n: int) -> dict[str, Any]:
    return {"position": n, "code": "NODE_READY", "kind": "node"}


async def test_slow_subscriber_loses_oldest_and_is_told() -> None:
    feed = EventFeed(queue_size=3)
    slow = feed.subscribe()
    for n in range(1, 6):
        feed.publish(message(n))
    batch = slow.take()
    assert batch[0] == Gap(2)
    assert [m["position"] for m in batch[1:] if isinstance(m, dict)] == [3, 4, 5]
    assert slow.dropped == 2 and feed.dropped == 2
    assert slow.take() == []  # the gap is reported once
    assert encode(Gap(2)) == b'event: gap\ndata: {"dropped":2}\n\n'


async def test_next_batch_times_out_empty_then_ends_when_closed() -> None:
    feed = EventFeed()
    sub = feed.subscribe()
    assert await sub.next_batch(0.05) == []
    feed.publish(message(1))
    feed.close()
    assert [m["position"] for m in await sub.next_batch(1) if isinstance(m, dict)] == [1]
    with pytest.raises(FeedClosed):
        await sub.next_batch(1)
    assert feed.subscriber_count == 0
    with pytest.raises(FeedClosed):  # subscribing to a closed feed ends at once
        await feed.subscribe().next_batch(1)


async def test_events_from_another_thread_arrive_on_the_loop_without_blocking_it() -> None:
    feed = EventFeed(queue_size=10)
    feed.bind(asyncio.get_running_loop(), after_position=1)
    sub = feed.subscribe()
    node = ready_node()
    events = node.collect_events()  # NODE_ENROLLED, NODE_READY
    started = time.perf_counter()

    def follower() -> None:
        for _ in range(1000):  # far more than the queue holds: the thread never waits
            for position, event in enumerate(events, start=1):
                feed.on_event(position, event)

    thread = threading.Thread(target=follower)
    thread.start()
    thread.join(timeout=10)
    assert time.perf_counter() - started < 5
    batch = await sub.next_batch(5)
    assert isinstance(batch[0], Gap)  # 1000 sent, 10 kept
    kept = [m for m in batch if isinstance(m, dict)]
    assert len(kept) == 10
    assert {m["code"] for m in kept} == {"NODE_READY"}  # position 1 is history: skipped
    first = kept[0]
    assert first["kind"] == "node" and first["aggregate_id"] == str(node.id)
    assert first["state"] == "READY" and first["position"] == 2 and first["summary"]


async def test_a_stream_ends_with_session_end_when_its_session_runs_out() -> None:
    feed = EventFeed(keepalive_seconds=5.0)  # the end comes long before any keepalive
    ends = time.time() + 0.3
    chunks: list[bytes] = []
    started = time.monotonic()
    async for chunk in sse_stream(feed, 7, lambda now: ends if now < ends else None):
        chunks.append(chunk)
        if len(chunks) == 1:
            feed.publish(message(8))
    elapsed = time.monotonic() - started
    ready, delivered, ended = chunks
    assert ready.startswith(b"retry: 3000\nevent: ready\ndata: ")
    assert orjson.loads(ready.split(b"data: ")[1])["position"] == 7
    assert 0 < orjson.loads(ready.split(b"data: ")[1])["ends_in"] <= 0.3
    assert b'"position":8' in delivered
    assert ended.startswith(b"event: session-end\ndata: ") and b"feed-tickets" in ended
    assert 0.25 <= elapsed < 2.0, elapsed  # woken at the session's end
    assert feed.subscriber_count == 0


async def test_nothing_that_arrives_after_the_session_is_sent() -> None:
    feed = EventFeed(keepalive_seconds=5.0)
    open_ = [True]
    stream = sse_stream(feed, 1, lambda now: float("inf") if open_[0] else None)
    assert (await anext(stream)).startswith(b"retry:")
    open_[0] = False
    feed.publish(message(2))
    assert (await anext(stream)).startswith(b"event: session-end")
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


@pytest.mark.parametrize("by", ["key", "ticket"])
async def test_a_stream_ends_at_its_next_wake_once_the_admin_key_changes(by: str) -> None:
    svc = SimpleNamespace(settings=Settings(admin_api_key="old-key"))
    ticket = issue_ticket("old-key", time.time()).ticket
    authorization = feed_authorization(
        svc,  # type: ignore[arg-type]
        "old-key" if by == "key" else None,
        ticket if by == "ticket" else None,
    )
    feed = EventFeed(keepalive_seconds=0.05)
    stream = sse_stream(feed, 1, authorization)
    ready = orjson.loads((await anext(stream)).split(b"data: ")[1])
    assert (ready["ends_in"] is None) == (by == "key")
    assert await anext(stream) == b": keepalive\n\n"
    svc.settings = dataclasses.replace(svc.settings, admin_api_key="new-key")
    assert (await anext(stream)).startswith(b"event: session-end")
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert feed.subscriber_count == 0


def test_feed_message_kinds() -> None:
    job = job_in("RUNNING")
    events = job.collect_events()
    chunk = feed_message(9, events[-1])
    assert chunk is not None
    assert chunk["kind"] == "job" and chunk["code"] == "TOKEN_STREAM_CHUNK"
    assert "1 token" in chunk["summary"]
    assert set(chunk) == {
        "position",
        "time",
        "code",
        "aggregate_id",
        "kind",
        "state",
        "version",
        "summary",
    }


def test_a_refused_attempt_reaches_the_dashboards_feed() -> None:
    refusal = AccessRefusal.record(
        kind="enroll",
        source="10.0.0.66",
        node_name="intruder",
        reason="security violation: advertised address 203.0.113.9 is outside the CIDRs",
        security_violation=True,
    )
    [event] = refusal.collect_events()
    message = feed_message(3, event)
    assert message is not None and (message["kind"], message["code"]) == (
        "access",
        "ACCESS_REFUSED",
    )
    assert message["summary"].startswith("enrollment from 10.0.0.66 refused (security violation)")


def test_prometheus_metrics_counts_events_and_collects_state() -> None:
    metrics = PrometheusMetrics()
    node = ready_node()
    job = job_in("RUNNING")
    metrics.count_after(1)
    for position, event in enumerate([*node.collect_events(), *job.collect_events()], start=1):
        metrics.on_event(position, event)
    metrics.observe_time_to_first_token(0.2)
    metrics.observe_inter_token(0.01)
    metrics.observe_append(0.003)
    live = {str(node.id): LiveNode(str(node.id), last_seen=time.time() - 2.0)}
    cluster = ClusterCollector(
        ClusterSources(
            nodes=lambda: [{"node_id": str(node.id), "name": "n1", "state": "READY"}],
            live=lambda: live,
            connected=lambda node_id: True,
            active_jobs=lambda: 1,
            store_position=lambda: 7,
            read_model_position=lambda: 7,
        )
    )
    metrics.add_collector(cluster)
    metrics.add_node_collector(NodeCollector(cluster.sources, cluster))
    public = metrics.exposition().decode()
    assert str(node.id) not in public and "n1" not in public  # /metrics names no node
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for text in (public, metrics.node_exposition().decode())
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("dacp_jobs_submitted_total", ())] == 1
    assert samples[("dacp_tokens_generated_total", ())] == 1
    assert samples[("dacp_jobs_finished_total", (("state", "COMPLETED"),))] == 0
    # position 1 (NODE_ENROLLED) was history when counting began
    assert ("dacp_events_applied_total", (("code", "NODE_ENROLLED"),)) not in samples
    assert samples[("dacp_events_applied_total", (("code", "NODE_READY"),))] == 1
    assert samples[("dacp_time_to_first_token_seconds_count", ())] == 1
    assert samples[("dacp_inter_token_latency_seconds_count", ())] == 1
    assert samples[("dacp_event_store_append_seconds_count", ())] == 1
    assert samples[("dacp_nodes", (("state", "READY"),))] == 1
    assert samples[("dacp_nodes", (("state", "OFFLINE"),))] == 0
    assert samples[("dacp_nodes_connected", ())] == 1
    age = samples[("dacp_node_heartbeat_age_seconds", (("name", "n1"), ("node_id", str(node.id))))]
    assert 1.5 < age < 10
    assert samples[("dacp_jobs_active", ())] == 1
    assert samples[("dacp_scrape_errors_total", ())] == 0


def test_a_failing_source_does_not_fail_the_scrape() -> None:
    metrics = PrometheusMetrics()

    def broken() -> list[dict[str, Any]]:
        raise ConnectionError("database down")

    metrics.add_collector(
        ClusterCollector(
            ClusterSources(
                nodes=broken,
                live=dict,
                connected=lambda node_id: False,
                active_jobs=lambda: 0,
                store_position=lambda: 0,
                read_model_position=lambda: 0,
            )
        )
    )
    text = metrics.exposition().decode()
    assert "dacp_scrape_errors_total 1.0" in text
    assert "dacp_nodes{" not in text
