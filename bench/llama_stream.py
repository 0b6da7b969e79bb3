"""The agent's CPU per token while it reads llama-server's stream: its lean client
(``agent/runtime/llama_stream.py``) against the same stream read through ``httpx``, as the
agent read it before, side by side in one run.

A stand-in server in a process of its own writes one llama-server-shaped event per token,
``--gap-ms`` apart (so each one wakes the reader, as llama.cpp's tokens do), chunked as
llama-server chunks them. Both readers split the events and parse them with the agent's own
functions; what is measured is this process's CPU time per event (``time.process_time``), the
two readers taking turns for ``--rounds`` rounds.

    python -m bench.llama_stream                 # 5 rounds of 2000 events
    python -m bench.llama_stream --events 500 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx
import orjson

from agent.runtime import llama_server
from agent.runtime.endpoints import free_loopback_port
from agent.runtime.llama_stream import LlamaStream

EVENT = b"data: " + orjson.dumps(
    {
        "choices": [{"finish_reason": None, "index": 0, "delta": {"content": " tok"}}],
        "created": 1,
        "id": "chatcmpl-bench",
        "model": "bench",
        "system_fingerprint": "b0",
        "object": "chat.completion.chunk",
    }
)
PATH = "/v1/chat/completions"
PAYLOAD = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})


async def stand_in(port: int, events: int, gap_s: float) -> None:
    """Answers every POST with ``events`` chunked SSE events, ``gap_s`` apart, then [DONE]."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return  # a probe that only connected
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event = EVENT + b"\n\n"
        for _ in range(events):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await asyncio.sleep(gap_s)
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def read_with_httpx(client: httpx.AsyncClient, port: int) -> int:
    count = 0
    url = f"http://127.0.0.1:{port}{PATH}"
    async with client.stream("POST", url, content=PAYLOAD) as resp:
        async for line in llama_server._sse_lines(resp.aiter_bytes()):
            if isinstance(llama_server._parse_sse_line(line), llama_server.ChatDelta):
                count += 1
    return count


async def read_lean(port: int) -> int:
    count = 0
    async with LlamaStream("127.0.0.1", port, PATH, PAYLOAD) as resp:
        async for line in llama_server._sse_lines(resp.body()):
            if isinstance(llama_server._parse_sse_line(line), llama_server.ChatDelta):
                count += 1
    return count


async def measure(port: int, rounds: int, events: int) -> dict[str, list[float]]:
    client = httpx.AsyncClient(verify=False)  # as the agent's client was: loopback, no CA
    readers: dict[str, Callable[[], Awaitable[int]]] = {
        "httpx": lambda: read_with_httpx(client, port),
        "lean": lambda: read_lean(port),
    }
    per_event: dict[str, list[float]] = {name: [] for name in readers}
    try:
        await read_lean(port)  # warm-up: imports, the stand-in's first connection
        for index in range(rounds):
            names = list(readers) if index % 2 == 0 else list(reversed(readers))
            for name in names:
                cpu = time.process_time()
                count = await readers[name]()
                if count != events:
                    raise SystemExit(f"{name} read {count} of the {events} events")
                per_event[name].append((time.process_time() - cpu) / max(count, 1) * 1e6)
    finally:
        await client.aclose()
    return per_event


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=2000, help="events per stream")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=0.5, help="between two events")
    args = parser.parse_args(argv)
    port = free_loopback_port("127.0.0.1")
    code = (
        "import asyncio, sys; from bench.llama_stream import stand_in; "
        f"asyncio.run(stand_in({port}, {args.events}, {args.gap_ms / 1000}))"
    )
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while not _accepts(port):
            if time.monotonic() > deadline:
                raise SystemExit("the stand-in server did not start")
            time.sleep(0.05)
        per_event = asyncio.run(measure(port, args.rounds, args.events))
    finally:
        server.kill()
        server.wait()
    print(f"{args.rounds} rounds of {args.events} events, {args.gap_ms} ms apart")
    print("agent CPU per event (µs)    median    min    max")
    for name, values in per_event.items():
        print(f"  {name:24} {statistics.median(values):8.1f} {min(values):6.1f} {max(values):6.1f}")
    ratio = statistics.median(
        lean / via for lean, via in zip(per_event["lean"], per_event["httpx"], strict=True)
    )
    print(f"lean / httpx, paired per round: {ratio:.2f}x")


if __name__ == "__main__":
    main()
