"""LoopHistogram exposes exactly what prometheus_client's own Histogram does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from infrastructure.loop_histogram import LoopHistogram
from infrastructure.metrics import INTER_TOKEN_BUCKETS

NAME = "dacp_test_latency_seconds"


def _exposition(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if not line.startswith("#") and "_created" not in line]


@given(
    st.lists(
        st.one_of(
            st.sampled_from(INTER_TOKEN_BUCKETS),  # on a bound: counted in that bucket (le)
            st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
        ),
        max_size=60,
    )
)
def test_buckets_count_and_sum_match_prometheus_client(values: list[float]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, "doc", buckets=INTER_TOKEN_BUCKETS, registry=theirs)
    histogram = LoopHistogram(NAME, "doc", INTER_TOKEN_BUCKETS)
    ours.register(histogram)
    for value in values:
        reference.observe(value)
        histogram.observe(value)
    assert _exposition(ours) == _exposition(theirs)


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LoopHistogram(NAME, "doc", (0.1, 0.01))
