"""gRPC keepalive on the control channel, the same on both ends.

Without it a link that silently drops packets (a pulled cable, a NAT that forgot the flow, a
firewall black hole) keeps a ``Connect`` stream "open" for as long as TCP's retransmissions
last (minutes): the agent never reconnects and the controller keeps sending plans into it.
Each end pings the other every ``interval`` seconds of silence and gives up on the
connection when an answer takes longer than ``timeout``; the server lets clients ping that
often (gRPC servers otherwise answer frequent pings with GOAWAY ``too_many_pings``).
"""

from __future__ import annotations

#: Seconds of silence before a ping, and how long an answer may take (the defaults; the
#: controller and the agent take others for tests).
DEFAULT_INTERVAL = 20.0
DEFAULT_TIMEOUT = 10.0

Options = list[tuple[str, int]]


def channel_options(
    interval: float = DEFAULT_INTERVAL, timeout: float = DEFAULT_TIMEOUT
) -> Options:
    """Options for the agent's channel to the controller."""
    return [
        ("grpc.keepalive_time_ms", int(interval * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout * 1000)),
        ("grpc.http2.ping_timeout_ms", int(timeout * 1000)),  # newer gRPC reads this one
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # ping however long the stream is quiet
        # gRPC otherwise spaces the pings it sends without receiving data by 5 minutes.
        ("grpc.http2.min_time_between_pings_ms", int(interval * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(interval * 1000)),
    ]


def server_options(interval: float = DEFAULT_INTERVAL, timeout: float = DEFAULT_TIMEOUT) -> Options:
    """Options for the controller's gRPC server."""
    return [
        ("grpc.keepalive_time_ms", int(interval * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout * 1000)),
        ("grpc.http2.ping_timeout_ms", int(timeout * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Accept the agents' pings at their interval (half of it, for timer jitter).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(interval * 500)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(interval * 500)),
    ]
