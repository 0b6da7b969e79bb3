"""Live state on real Redis: heartbeats stay in process, Redis is written behind them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from infrastructure.live_state import InProcessLiveState, RedisLiveState, WriteBehindLiveState
from tests.conftest import TEST_REDIS_URL


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"dacp-test:live:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


def controller(prefix: str) -> WriteBehindLiveState:
    return WriteBehindLiveState(RedisLiveState(TEST_REDIS_URL, prefix), flush_interval=3600)


def test_a_heartbeat_is_visible_here_at_once_and_to_other_controllers_after_a_flush(
    prefix: str,
) -> None:
    here, there = controller(prefix), controller(prefix)
    here.record_heartbeat("n1", {"ram_free_bytes": 5}, 100.0)
    assert here.get("n1") is not None and here.get("n1").telemetry == {"ram_free_bytes": 5}  # type: ignore[union-attr]
    assert RedisLiveState(TEST_REDIS_URL, prefix).all() == {}  # nothing written yet
    here.flush()
    there.flush()
    seen = there.all()["n1"]
    assert seen.last_seen == 100.0 and seen.connected and seen.telemetry == {"ram_free_bytes": 5}


def test_the_newest_entry_wins_when_a_node_moves_to_another_controller(prefix: str) -> None:
    here, there = controller(prefix), controller(prefix)
    here.record_heartbeat("n1", {}, 100.0)
    here.mark_connected("n1", False, 101.0)  # its stream to this controller closed
    here.flush()
    there.record_heartbeat("n1", {}, 105.0)  # it reconnected to the other one
    there.flush()
    here.flush()
    moved = here.get("n1")
    assert moved is not None and moved.connected and moved.last_seen == 105.0


def test_redis_restarting_empty_is_refilled_by_the_next_flush(prefix: str) -> None:
    here = controller(prefix)
    here.record_heartbeat("n1", {}, 100.0)
    here.flush()
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    here.record_heartbeat("n1", {}, 102.0)
    here.flush()
    assert RedisLiveState(TEST_REDIS_URL, prefix).all()["n1"].last_seen == 102.0
    assert here.get("n1").last_seen == 102.0  # type: ignore[union-attr]


def test_redis_down_keeps_this_controllers_view_and_writes_when_back(prefix: str) -> None:
    down = WriteBehindLiveState(RedisLiveState("redis://127.0.0.1:1/0", prefix), 3600)
    down.record_heartbeat("n1", {}, 100.0)
    down.flush()  # logs, does not raise
    assert down.get("n1") is not None and not down.ping()
    # The same entries reach Redis once it answers again.
    down.backend = RedisLiveState(TEST_REDIS_URL, prefix)
    down.flush()
    assert RedisLiveState(TEST_REDIS_URL, prefix).all()["n1"].last_seen == 100.0


def test_a_flush_reads_back_only_nodes_not_connected_here_and_sets_ttls(prefix: str) -> None:
    here, there = controller(prefix), controller(prefix)
    here.record_heartbeat("mine", {}, 100.0)
    there.record_heartbeat("theirs", {}, 100.0)
    there.flush()
    here.flush()
    backend = RedisLiveState(TEST_REDIS_URL, prefix)
    assert set(backend.all(skip={"mine"})) == {"theirs"}
    assert set(here.all()) == {"mine", "theirs"}
    client = redis.Redis.from_url(TEST_REDIS_URL)
    assert 0 < client.ttl(f"{prefix}node:mine") <= 24 * 3600  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["redis", "in-process"])
def test_controller_leases_live_until_they_run_out_or_are_given_up(prefix: str, kind: str) -> None:
    live = controller(prefix) if kind == "redis" else InProcessLiveState()
    other = controller(prefix) if kind == "redis" else live  # another process, same Redis
    live.renew_lease("a", 30.0)
    other.renew_lease("b", 0.05)
    assert {"a", "b"} <= live.live_owners()
    deadline = time.monotonic() + 5
    while "b" in live.live_owners():  # ran out
        assert time.monotonic() < deadline
    live.renew_lease("a", 0)  # given up
    assert not {"a", "b"} & live.live_owners()
