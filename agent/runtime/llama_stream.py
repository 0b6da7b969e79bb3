"""One streamed answer from llama-server over loopback: a lean HTTP/1.1 exchange on asyncio
streams, for the agent's per-token path.

llama-server sends one server-sent event per token. Through an HTTP library each event went up
through its connection pool, stream and byte-iterator layers: about twice the agent's CPU per
token that reading the socket here takes, on a machine where every wake-up between two tokens
is taken from llama.cpp's own threads (``python -m bench.llama_stream`` measures both).
This module does what that one exchange needs and nothing more: one request on its own
connection (``Connection: close``, so a closed stream is a closed connection, which makes
llama-server stop generating), a status line and headers, and a body framed by chunked
transfer coding, a ``Content-Length`` or the connection's end. Anything else llama-server is
asked (health, embeddings) goes through ``httpx``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType

#: The most a status line, the headers, or one chunk-size line may take.
MAX_HEAD_BYTES = 64 * 1024
#: The most of a refusal's body that is read (its message is all that is kept).
MAX_ERROR_BODY_BYTES = 256 * 1024
#: One socket read.
READ_BYTES = 64 * 1024


class StreamProtocolError(ValueError):
    """llama-server's answer broke HTTP/1.1's framing (or went beyond a bound here)."""


class LlamaStream:
    """One POST and its answer. ``async with`` opens the connection and reads the status and
    headers; then :meth:`body` gives the body's bytes as they come (or :meth:`read_all` all of
    it, for a refusal). Leaving the ``async with`` closes the connection."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        payload: bytes,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 300.0,
    ) -> None:
        self._host = host
        self._port = port
        self._path = path
        self._payload = payload
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._rest = b""  # bytes read past the headers

    async def __aenter__(self) -> LlamaStream:
        async with asyncio.timeout(self._connect_timeout):
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        try:
            await self._start()
        except BaseException:
            # Cancelled (the job was) or failed before the body: the ``async with`` body never
            # runs and ``__aexit__`` is not called, so the connection is closed here, which
            # also makes llama-server drop the request.
            self.close()
            raise
        return self

    async def _start(self) -> None:
        assert self._writer is not None
        self._writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (
                self._path.encode("ascii"),
                self._host.encode("ascii"),
                self._port,
                len(self._payload),
                self._payload,
            )
        )
        async with asyncio.timeout(self._read_timeout):
            head = await self._head()
        self.status, self.headers = parse_head(head)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # no wait for the close: nothing more is said on it

    async def _head(self) -> bytes:
        assert self._reader is not None
        buffer = b""
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end >= 0:
                self._rest = buffer[end + 4 :]
                return buffer[:end]
            if len(buffer) > MAX_HEAD_BYTES:
                raise StreamProtocolError(f"headers longer than {MAX_HEAD_BYTES} bytes")
            data = await self._reader.read(READ_BYTES)
            if not data:
                raise StreamProtocolError("the connection closed before the headers ended")
            buffer += data

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes, in the pieces they come in (never an empty piece). A read that
        waits longer than the read timeout raises ``TimeoutError``; a body cut short raises
        :class:`StreamProtocolError`."""
        assert self._reader is not None
        reader = self._reader
        framing = body_framing(self.headers)
        decoder = ChunkedDecoder() if framing == CHUNKED else None
        remaining = framing if isinstance(framing, int) else -1
        data = self._rest
        self._rest = b""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as deadline:
            while True:
                if data:
                    if decoder is not None:
                        piece = decoder.feed(data)
                        if piece:
                            yield piece
                        if decoder.done:
                            return
                    else:
                        if remaining >= 0:
                            data = data[:remaining]
                            remaining -= len(data)
                        yield data
                        if remaining == 0:
                            return
                deadline.reschedule(loop.time() + self._read_timeout)
                data = await reader.read(READ_BYTES)
                if not data:
                    if decoder is None and remaining < 0:
                        return  # the body ends with the connection
                    raise StreamProtocolError("the connection closed before the body ended")

    async def read_all(self, limit: int = MAX_ERROR_BODY_BYTES) -> bytes:
        """The whole body (at most ``limit`` bytes of it)."""
        parts: list[bytes] = []
        size = 0
        async for piece in self.body():
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return b"".join(parts)[:limit]


CHUNKED = "chunked"


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names in lower case; a repeated one keeps its last
    value) of a response's head, without its final blank line."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        shown = lines[0][:100].decode("latin-1")
        raise StreamProtocolError(f"not an HTTP/1.x status line: {shown!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise StreamProtocolError(f"a header line without a colon: {line[:100]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(parts[1]), headers


def body_framing(headers: dict[str, str]) -> str | int | None:
    """How the body ends: :data:`CHUNKED`, after a length, or (None) with the connection."""
    coding = headers.get("transfer-encoding", "").lower()
    if coding:
        if coding.rsplit(",", 1)[-1].strip() != CHUNKED:
            raise StreamProtocolError(f"a transfer coding this client does not read: {coding}")
        return CHUNKED
    length = headers.get("content-length")
    if length is None:
        return None
    if not length.isdigit():
        raise StreamProtocolError(f"a malformed Content-Length: {length[:40]!r}")
    return int(length)


class ChunkedDecoder:
    """HTTP/1.1 chunked transfer coding, decoded incrementally: :meth:`feed` takes the bytes
    as they come and returns the body bytes they complete; :attr:`done` once the last chunk
    (size 0) came. Chunk extensions and trailers are read past."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of the current chunk's data still to come
        self._crlf = False  # the current chunk's data ended: its CRLF comes next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        at = 0
        end = len(buffer)
        while at < end and not self.done:
            if self._left:
                take = min(self._left, end - at)
                out.append(buffer[at : at + take])
                at += take
                self._left -= take
                if not self._left:
                    self._crlf = True
                continue
            if self._crlf:
                if end - at < 2:
                    break
                if buffer[at : at + 2] != b"\r\n":
                    raise StreamProtocolError("a chunk's data did not end with CRLF")
                at += 2
                self._crlf = False
                continue
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                if end - at > MAX_HEAD_BYTES:
                    raise StreamProtocolError("a chunk-size line too long")
                break
            size_text = buffer[at:line_end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise StreamProtocolError(f"a malformed chunk size: {size_text[:40]!r}") from None
            if size < 0:
                raise StreamProtocolError(f"a malformed chunk size: {size_text[:40]!r}")
            at = line_end + 2
            if size == 0:
                self.done = True  # trailers, if any, are not read
            else:
                self._left = size
        self._buffer = buffer[at:] if at < end and not self.done else b""
        return b"".join(out) if len(out) != 1 else out[0]
