"""The floor under the relay's CPU per message: a grpc.aio server that only reads.

The controller receives every token message on a gRPC bidirectional stream (grpcio's asyncio
API). This measures what grpcio itself costs per received message, with nothing else in the
server: ``--streams`` client streams (one client process) each send a small message every
``--interval`` seconds to a server process whose handler only counts them. The server's CPU
(user + system) per message is the floor the controller's relay cannot go below on this
machine and transport; ``make bench-capacity`` measures the controller on top of it.

Several shapes run side by side in one invocation (``--shape STREAMS:INTERVAL``); the defaults
are the capacity benchmark's relay loads (100 streams, one message every 50 ms or 200 ms) and
its idle load (1,000 streams, one heartbeat every 2 s).

    python -m bench.grpc_floor
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import psutil

from common import event_loop

METHOD = "/floor.Floor/Connect"
PAYLOAD = b"x" * 120  # about a TokenChunk of one short delta
DEFAULT_SHAPES = ("100:0.05", "100:0.2", "1000:2.0")
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


@dataclass(frozen=True)
class Floor:
    streams: int
    interval_s: float
    messages_per_second: float
    server_core_share: float
    server_us_per_message: float


async def _read_only(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    while await context.read() is not _EOF:
        pass
    return
    yield b""  # a stream-stream handler is an async generator


async def _serve(ports: Any) -> None:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(_read_only)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("floor.Floor", {"Connect": handler})]
    )
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _server_main(ports: Any) -> None:
    event_loop.run(_serve(ports))


async def _clients(port: int, streams: int, interval: float) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    connect = channel.stream_stream(METHOD, None, None)  # bytes in, bytes out

    async def messages(index: int) -> AsyncIterator[bytes]:
        await asyncio.sleep(interval * index / streams)  # spread evenly over the interval
        while True:
            yield PAYLOAD
            await asyncio.sleep(interval)

    calls = [connect(messages(i)) for i in range(streams)]
    await asyncio.Event().wait()  # until terminated
    del calls


def _clients_main(port: int, streams: int, interval: float) -> None:
    event_loop.run(_clients(port, streams, interval))


def measure(streams: int, interval: float, seconds: float) -> Floor:
    # Spawned, not forked: a process that has used gRPC cannot fork a working gRPC child.
    spawn = mp.get_context("spawn")
    ports: Any = spawn.Queue()
    server = spawn.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    port = ports.get(timeout=30)
    clients = spawn.Process(target=_clients_main, args=(port, streams, interval), daemon=True)
    clients.start()
    try:
        time.sleep(interval + 3.0)  # every stream open and sending
        process = psutil.Process(server.pid)
        before, started = process.cpu_times(), time.perf_counter()
        time.sleep(seconds)
        after, wall = process.cpu_times(), time.perf_counter() - started
    finally:
        clients.terminate()
        server.terminate()
        clients.join(10)
        server.join(10)
    cpu = (after.user + after.system) - (before.user + before.system)
    rate = streams / interval
    return Floor(streams, interval, rate, cpu / wall, 1e6 * cpu / (rate * wall))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", metavar="STREAMS:INTERVAL")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args(argv)
    print("grpc.aio server that only reads (plaintext, loopback):")
    print(f"{'streams':>8} {'interval':>9} {'msg/s':>7} {'server CPU':>11} {'per message':>12}")
    for shape in args.shape or DEFAULT_SHAPES:
        streams, interval = shape.split(":")
        floor = measure(int(streams), float(interval), args.seconds)
        print(
            f"{floor.streams:>8} {floor.interval_s:>8g}s {floor.messages_per_second:>7.0f} "
            f"{floor.server_core_share:>10.1%} {floor.server_us_per_message:>9.0f} µs",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
