"""A raw HTTP/1.1 client for streamed chat completions: asyncio streams, no HTTP library.

The capacity benchmark runs hundreds of streams from one process on the same two cores as the
controller; an HTTP library's per-chunk work would take CPU the controller needs and blur what
is measured. This client sends one request per connection and reads the chunked SSE body with
a few bytes operations per chunk: the time to the first content token, the number of synthetic
tokens received (each is the text ``" tok"``), and the completion id.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson

TOKEN = b" tok"  # what bench.synthetic_agents sends as each token's text


@dataclass
class StreamResult:
    status: int = 0
    ttft: float | None = None
    seconds: float = 0.0
    tokens: int = 0
    completion_id: str = ""
    error: str = ""


async def stream_chat(
    host: str, port: int, api_key: str, body: dict[str, object], timeout: float = 900.0
) -> StreamResult:
    """POSTs ``body`` to /v1/chat/completions and reads the streamed answer to its end."""
    result = StreamResult()
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await _exchange(host, port, api_key, orjson.dumps(body), result, start)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        result.error = result.error or repr(e)
    result.seconds = time.perf_counter() - start
    return result


async def _exchange(
    host: str, port: int, api_key: str, payload: bytes, result: StreamResult, start: float
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + f"Host: {host}:{port}\r\nAuthorization: Bearer {api_key}\r\n".encode()
            + b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        status_line = await reader.readline()
        result.status = int(status_line.split()[1])
        chunked, length = False, -1
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"content-length":
                length = int(value)
        if not chunked:
            body = await (reader.readexactly(length) if length >= 0 else reader.read())
            if result.status != 200:
                result.error = body.decode(errors="replace")[:200]
            return
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)
            if result.status != 200:
                result.error += data[:-2].decode(errors="replace")[:200]
                continue
            pending += data[:-2]
            events, _, pending = pending.rpartition(b"\n\n")
            if not events:
                continue
            if not result.completion_id and events.startswith(b"data: {"):
                first = events.split(b"\n\n", 1)[0]
                result.completion_id = str(orjson.loads(first[6:]).get("id", ""))
            count = events.count(TOKEN)
            if count:
                if result.ttft is None:
                    result.ttft = time.perf_counter() - start
                result.tokens += count
    finally:
        writer.close()
