"""The dashboard's history ring buffer: samples taken on demand with an injected clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from application.metrics_history import (
    DEFAULT_HISTORY_INTERVAL,
    HISTORY_POINTS,
    DevicePoint,
    HistorySources,
    MetricsHistory,
    NodePoint,
    percentile,
)
from infrastructure.settings import Settings, SettingsError


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTokenChunk:
    code: ClassVar[str] = "TOKEN_STREAM_CHUNK"

    def __init__(self, token_count: int) -> None:
        self.token_count = token_count


class FakeJobCompleted:
    code: ClassVar[str] = "JOB_COMPLETED"
    token_count = 99  # not a chunk: never counted


def history(
    clock: FakeClock,
    *,
    depth: int = 0,
    nodes: Sequence[NodePoint] = (),
    points: int = HISTORY_POINTS,
) -> MetricsHistory:
    sources = HistorySources(queue_depth=lambda: depth, nodes=lambda: nodes, clock=clock)
    return MetricsHistory(sources, interval=10.0, points=points)


def test_tokens_per_second_over_each_interval() -> None:
    clock = FakeClock()
    h = history(clock)
    for position, tokens in enumerate((10, 15, 5), start=1):
        h.on_event(position, FakeTokenChunk(tokens))
    clock.now += 10
    assert h.sample().tokens_per_second == 3.0
    clock.now += 5
    h.on_event(4, FakeTokenChunk(1))
    assert h.sample().tokens_per_second == 0.2
    clock.now += 10
    assert h.sample().tokens_per_second == 0.0


def test_only_new_token_chunks_count() -> None:
    clock = FakeClock()
    h = history(clock)
    h.count_after(5)
    h.on_event(5, FakeTokenChunk(100))  # caught up on at start: history, not news
    h.on_event(6, FakeJobCompleted())
    h.on_event(7, FakeTokenChunk(20))
    clock.now += 10
    assert h.sample().tokens_per_second == 2.0


def test_time_to_first_token_percentiles_per_interval() -> None:
    clock = FakeClock()
    h = history(clock)
    for tenth in range(10, 0, -1):
        h.observe_time_to_first_token(tenth / 10)
    clock.now += 10
    first = h.sample()
    assert (first.ttft_p50_ms, first.ttft_p95_ms) == (500.0, 1000.0)
    clock.now += 10
    quiet = h.sample()  # no request got its first token: no figure, not zero
    assert (quiet.ttft_p50_ms, quiet.ttft_p95_ms) == (None, None)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 95) == 4.0


def test_the_ring_keeps_the_newest_points() -> None:
    clock = FakeClock()
    h = history(clock, points=3)
    for _ in range(5):
        clock.now += 10
        h.sample()
    assert [s.time for s in h.samples()] == [1030.0, 1040.0, 1050.0]
    assert [s.time for s in h.samples(since=1040.0)] == [1050.0]
    assert h.samples(since=1050.0) == []


def test_a_sample_holds_the_queue_and_the_nodes() -> None:
    clock = FakeClock()
    gpu = DevicePoint("CUDA0", 8 << 30, 6 << 30)
    node = NodePoint("n1", "alpha", busy_slots=1, slots=2, cpu_percent=12.5, devices=(gpu,))
    h = history(clock, depth=4, nodes=[node])
    clock.now += 10
    taken = h.sample()
    assert taken.queue_depth == 4
    assert taken.nodes == (node,)
    assert h.samples() == [taken]


def test_a_failing_nodes_source_leaves_the_nodes_out() -> None:
    def broken() -> Sequence[NodePoint]:
        raise RuntimeError("store away")

    clock = FakeClock()
    h = MetricsHistory(HistorySources(lambda: 2, broken, clock), interval=10.0)
    clock.now += 10
    taken = h.sample()
    assert (taken.queue_depth, taken.nodes) == (2, ())


def test_refuses_a_history_without_interval_or_points() -> None:
    sources = HistorySources(queue_depth=lambda: 0, clock=FakeClock())
    with pytest.raises(ValueError, match="interval"):
        MetricsHistory(sources, interval=0)
    with pytest.raises(ValueError, match="point"):
        MetricsHistory(sources, points=0)


def test_the_interval_is_a_setting() -> None:
    assert Settings.from_env({}).metrics_history_interval == DEFAULT_HISTORY_INTERVAL == 10.0
    given = Settings.from_env({"METRICS_HISTORY_INTERVAL": "0.5"})
    assert given.metrics_history_interval == 0.5
    with pytest.raises(SettingsError, match="METRICS_HISTORY_INTERVAL"):
        Settings.from_env({"METRICS_HISTORY_INTERVAL": "0"})
