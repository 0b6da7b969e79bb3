"""The control channel's latency benchmark runs (small): every path echoes every round, and
each is reported with its time over the TLS stream's, paired per round."""

from __future__ import annotations

import pytest

from bench import grpc_latency

pytestmark = pytest.mark.timeout(120)


def test_a_small_run_reports_every_path() -> None:
    results = grpc_latency.measure(rounds=20, pause_ms=1.0, warmup=5)
    assert [r.path for r in results] == list(grpc_latency.PATHS)
    for result in results:
        assert 0 < result.round_trip_us["p50"] <= result.round_trip_us["p90"]
        assert result.over_base > 0
    base = next(r for r in results if r.path == grpc_latency.BASE)
    assert base.over_base == 1.0
