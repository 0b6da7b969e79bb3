"""The gRPC floor benchmark runs and reports a server CPU per message (a small shape)."""

from __future__ import annotations

from bench import grpc_floor


def test_a_small_floor_measurement_reports_the_server_cost() -> None:
    # Enough messages that the server's CPU shows above psutil's 10 ms clock tick.
    floor = grpc_floor.measure(streams=50, interval=0.02, seconds=1.0)
    assert floor.messages_per_second == 2500
    # The server did read: it spent CPU, and less than a whole core on it.
    assert 0 < floor.server_core_share < 1
    assert floor.server_us_per_message > 0
