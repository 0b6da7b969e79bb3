"""The agent's lean HTTP/1.1 client for llama-server's streamed answers
(agent/runtime/llama_stream.py): chunked decoding however the bytes are cut, the framings of a
body, and what a broken answer raises, against small asyncio servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.llama_stream import (
    CHUNKED,
    ChunkedDecoder,
    LlamaStream,
    StreamProtocolError,
    body_framing,
    parse_head,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunked(pieces: list[bytes], extension: bytes = b"") -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p)
    return out + b"0\r\n\r\n"


@given(
    st.lists(st.binary(min_size=1, max_size=40), max_size=12),
    st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=60),
    st.sampled_from([b"", b";ext=1"]),
)
def test_chunked_decoding_does_not_depend_on_how_the_bytes_are_cut(
    pieces: list[bytes], cuts: list[int], extension: bytes
) -> None:
    encoded = chunked(pieces, extension) + b"after the end"
    decoder = ChunkedDecoder()
    out = b""
    at = 0
    for size in cuts * (len(encoded) // sum(cuts) + 1):
        if at >= len(encoded) or decoder.done:
            break
        out += decoder.feed(encoded[at : at + size])
        at += size
    assert decoder.done
    assert out == b"".join(pieces)


@pytest.mark.parametrize(
    "encoded, message",
    [
        (b"zz\r\nab\r\n", "malformed chunk size"),
        (b"-2\r\nab\r\n", "malformed chunk size"),
        (b"2\r\nabXY", "did not end with CRLF"),
        (b"1" * 70_000, "chunk-size line too long"),
    ],
)
def test_broken_chunked_framing_is_refused(encoded: bytes, message: str) -> None:
    with pytest.raises(StreamProtocolError, match=message):
        ChunkedDecoder().feed(encoded)


def test_a_head_is_parsed_into_status_and_lowercase_headers() -> None:
    status, headers = parse_head(
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nX-A:  1 "
    )
    assert status == 400
    assert headers == {"content-type": "application/json", "x-a": "1"}
    with pytest.raises(StreamProtocolError, match="status line"):
        parse_head(b"SSH-2.0-OpenSSH\r\n")
    with pytest.raises(StreamProtocolError, match="without a colon"):
        parse_head(b"HTTP/1.1 200 OK\r\nbroken")


def test_the_framing_of_a_body() -> None:
    assert body_framing({"transfer-encoding": "chunked"}) == CHUNKED
    assert body_framing({"content-length": "12"}) == 12
    assert body_framing({}) is None
    with pytest.raises(StreamProtocolError, match="transfer coding"):
        body_framing({"transfer-encoding": "gzip"})
    with pytest.raises(StreamProtocolError, match="Content-Length"):
        body_framing({"content-length": "-1"})


async def serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


async def collect(stream: LlamaStream) -> list[bytes]:
    return [piece async for piece in stream.body()]


async def test_a_chunked_stream_comes_piece_by_piece_as_it_is_written() -> None:
    seen: list[tuple[bytes, bytes]] = []
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server, port = await serve(handler)
    async with server, LlamaStream("127.0.0.1", port, "/v1/x", b'{"a":1}') as stream:
        assert stream.status == 200
        pieces = stream.body()
        assert await anext(pieces) == b"first"  # before the rest is even written
        release.set()
        assert [piece async for piece in pieces] == [b"second"]
    head, body = seen[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"Connection: close" in head and body == b'{"a":1}'


async def test_a_body_with_a_length_or_to_the_connections_end() -> None:
    async def with_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad\r\nContent-Length: 5\r\n\r\nerror and more")
        await writer.drain()

    async def to_the_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 500 Oops\r\n\r\nall of it")
        writer.close()

    server, port = await serve(with_length)
    async with server, LlamaStream("127.0.0.1", port, "/", b"{}") as stream:
        assert (stream.status, await stream.read_all()) == (400, b"error")
    server, port = await serve(to_the_end)
    async with server, LlamaStream("127.0.0.1", port, "/", b"{}") as stream:
        assert (stream.status, b"".join(await collect(stream))) == (500, b"all of it")


async def test_a_body_cut_short_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfir")
        writer.close()

    server, port = await serve(handler)
    async with server, LlamaStream("127.0.0.1", port, "/", b"{}") as stream:
        with pytest.raises(StreamProtocolError, match="closed before the body ended"):
            await collect(stream)


async def test_no_answer_within_the_read_timeout_raises_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    server, port = await serve(handler)
    async with server, LlamaStream("127.0.0.1", port, "/", b"{}", read_timeout=0.2) as stream:
        pieces = stream.body()
        assert await anext(pieces) == b"ok"
        with pytest.raises(TimeoutError):
            await anext(pieces)


async def test_leaving_the_stream_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        await writer.drain()
        assert await reader.read() == b""  # the client's end of the connection
        closed.set()

    server, port = await serve(handler)
    async with server:
        async with LlamaStream("127.0.0.1", port, "/", b"{}") as stream:
            assert await anext(stream.body()) == b"ok"
        await asyncio.wait_for(closed.wait(), 5)


async def test_cancelled_before_the_headers_closes_the_connection() -> None:
    """A job cancelled while llama-server has not answered yet (all its slots busy, say): the
    connection closes, so llama-server drops the request instead of running it for nobody."""
    asked, closed = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        asked.set()
        assert await reader.read() == b""  # no answer sent: the client hangs up
        closed.set()

    server, port = await serve(handler)
    async with server:
        # Held here, as a traceback or a caller may hold it: its closing cannot be left to
        # garbage collection.
        stream = LlamaStream("127.0.0.1", port, "/", b"{}")

        async def ask() -> None:
            async with stream:
                raise AssertionError("no headers came: the body must not run")

        task = asyncio.create_task(ask())
        await asyncio.wait_for(asked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 5)


async def test_a_refused_connection_raises_oserror() -> None:
    server, port = await serve(lambda reader, writer: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        async with LlamaStream("127.0.0.1", port, "/", b"{}"):
            pass


async def test_headers_that_never_end_are_refused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20_000)
        await writer.drain()
        await asyncio.sleep(5)

    server, port = await serve(handler)
    async with server:
        with pytest.raises(StreamProtocolError, match="headers longer"):
            async with LlamaStream("127.0.0.1", port, "/", b"{}"):
                pass
