"""What one hop over the control channel costs in latency: grpcio's asyncio API against a
plain asyncio stream, each with and without TLS, side by side in one run.

A warm one-node request crosses the control channel twice before its first token reaches the
client: the plan to the agent, and the first piece back. ``bench/grpc_floor.py`` measures
what grpcio costs in CPU per message; this measures what it costs in time. Four echo servers,
each in a process of its own on uvloop, answer a small message (about a ``TokenChunk`` of one
delta) on one open stream:

* ``grpc`` and ``grpc-tls``: a ``grpc.aio`` bidirectional stream (the control channel's
  transport), plaintext and over TLS with a certificate of the controller's own kind of CA;
* ``stream`` and ``stream-tls``: an asyncio stream (``asyncio.start_server``), plaintext and
  over TLS with the same certificate.

One client process sends a message and waits for its echo on each in turn, rotating the order
every round, with a pause between rounds (the relay's messages come tens of milliseconds
apart, so each round trip starts from idle as they do). It prints the round trip's p50 and
p90, and each path's time over ``stream-tls``'s paired per round (the same process pair,
the same TLS, no gRPC).

    python -m bench.grpc_latency                 # 2,000 rounds
    python -m bench.grpc_latency --rounds 500 --pause-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import ssl
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import stats
from common import event_loop
from infrastructure import tls

METHOD = "/latency.Echo/Connect"
PAYLOAD = b"x" * 120  # about a TokenChunk of one short delta
PATHS = ("grpc", "grpc-tls", "stream", "stream-tls")
BASE = "stream-tls"
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class PathResult:
    path: str
    round_trip_us: dict[str, float]
    #: The path's round trip over BASE's, the median of the per-round ratios.
    over_base: float


# --- servers (each in a spawned process) -------------------------------------------------


async def _echo(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    while (message := await context.read()) is not _EOF:
        await context.write(message)
    return
    yield b""  # a stream-stream handler is an async generator


async def _serve_grpc(ports: Any, cert: tls.ServerTls | None) -> None:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("latency.Echo", {"Connect": handler})]
    )
    if cert is None:
        ports.put(server.add_insecure_port("127.0.0.1:0"))
    else:
        credentials = grpc.ssl_server_credentials([(cert.key_pem, cert.chain_pem)])
        ports.put(server.add_secure_port("127.0.0.1:0", credentials))
    await server.start()
    await server.wait_for_termination()


async def _echo_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(_LENGTH.size)
            body = await reader.readexactly(_LENGTH.unpack(head)[0])
            writer.write(head + body)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve_stream(ports: Any, cert: tls.ServerTls | None) -> None:
    context = None
    if cert is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert.chain_file, cert.key_file)
    server = await asyncio.start_server(_echo_frames, "127.0.0.1", 0, ssl=context)
    ports.put(server.sockets[0].getsockname()[1])
    await server.serve_forever()


def _server_main(path: str, ports: Any, cert: tls.ServerTls) -> None:
    secure = cert if path.endswith("-tls") else None
    serve = _serve_grpc if path.startswith("grpc") else _serve_stream
    event_loop.run(serve(ports, secure))


# --- the client ---------------------------------------------------------------------------

RoundTrip = Callable[[], Awaitable[None]]


async def _grpc_client(port: int, cert: tls.ServerTls | None) -> tuple[RoundTrip, Any]:
    if cert is None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    else:
        credentials = grpc.ssl_channel_credentials(cert.ca_pem)
        options = [("grpc.ssl_target_name_override", cert.server_name)]
        channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
    # bytes in, bytes out; called without an iterator, the call is written and read by hand
    connect: Any = channel.stream_stream(METHOD, None, None)
    call = connect()

    async def round_trip() -> None:
        await call.write(PAYLOAD)
        if await call.read() != PAYLOAD:
            raise RuntimeError("the gRPC echo answered something else")

    return round_trip, channel


async def _stream_client(port: int, cert: tls.ServerTls | None) -> tuple[RoundTrip, Any]:
    context = None
    if cert is not None:
        context = ssl.create_default_context(cafile=None, cadata=cert.ca_pem.decode())
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=cert.server_name if cert else None
    )
    frame = _LENGTH.pack(len(PAYLOAD)) + PAYLOAD

    async def round_trip() -> None:
        writer.write(frame)
        if await reader.readexactly(len(frame)) != frame:
            raise RuntimeError("the stream echo answered something else")

    return round_trip, writer


async def _measure(
    ports: dict[str, int], cert: tls.ServerTls, rounds: int, pause: float, warmup: int
) -> dict[str, list[float]]:
    clients: dict[str, RoundTrip] = {}
    closers: list[Any] = []
    for path in PATHS:
        secure = cert if path.endswith("-tls") else None
        connect = _grpc_client if path.startswith("grpc") else _stream_client
        clients[path], closer = await connect(ports[path], secure)
        closers.append(closer)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        for index in range(warmup + rounds):
            shift = index % len(PATHS)
            for path in PATHS[shift:] + PATHS[:shift]:
                started = time.perf_counter()
                await clients[path]()
                if index >= warmup:
                    times[path].append((time.perf_counter() - started) * 1e6)
                await asyncio.sleep(pause)
    finally:
        for closer in closers:
            result = closer.close()
            if asyncio.iscoroutine(result):
                await result
    return times


def measure(rounds: int, pause_ms: float, warmup: int = 50) -> list[PathResult]:
    """Round trips on every path, interleaved; one result per path, in :data:`PATHS` order."""
    spawn = mp.get_context("spawn")  # a process that has used gRPC cannot fork a gRPC child
    with tempfile.TemporaryDirectory(prefix="dacp-grpc-latency-") as tmp:
        cert = tls.load_or_create(Path(tmp))  # the controller's own kind of CA and certificate
        servers: list[Any] = []
        ports: dict[str, int] = {}
        try:
            for path in PATHS:
                queue: Any = spawn.Queue()
                server = spawn.Process(target=_server_main, args=(path, queue, cert), daemon=True)
                server.start()
                servers.append(server)
                ports[path] = queue.get(timeout=30)
            times = event_loop.run(_measure(ports, cert, rounds, pause_ms / 1000, warmup))
        finally:
            for server in servers:
                server.terminate()
                server.join(10)
    results = []
    for path in PATHS:
        ratios = [mine / base for mine, base in zip(times[path], times[BASE], strict=True)]
        results.append(
            PathResult(
                path,
                {
                    "p50": round(stats.percentile(times[path], 50), 1),
                    "p90": round(stats.percentile(times[path], 90), 1),
                },
                round(stats.percentile(ratios, 50), 2),
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.grpc_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--pause-ms", type=float, default=2.0, help="between round trips")
    args = parser.parse_args(argv)
    results = measure(args.rounds, args.pause_ms)
    print(
        f"round trip of a {len(PAYLOAD)}-byte message on loopback, {args.rounds} rounds, "
        f"{args.pause_ms:g} ms apart (paths interleaved):"
    )
    print(f"{'path':<12}{'p50 us':>9}{'p90 us':>9}{f'/ {BASE} (paired)':>24}")
    for result in results:
        rt = result.round_trip_us
        print(f"{result.path:<12}{rt['p50']:>9.1f}{rt['p90']:>9.1f}{result.over_base:>23.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
