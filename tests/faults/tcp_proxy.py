"""A TCP proxy between agents and the controller that cuts or black-holes its connections.

``cut()`` closes every open connection (a crashed peer, a reset link). ``black_hole()`` stops
forwarding on every open connection but keeps the sockets open (a pulled cable, a NAT that
forgot the flow): neither end hears anything, not even a close. New connections are
forwarded, so a peer that notices and reconnects gets through, unless an ``outage`` is on:
then they are refused (a cut link) or swallowed (a black hole) until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    holes: asyncio.Event = field(default_factory=asyncio.Event)  # set: drop everything


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.links: list[_Link] = []
        self.accepted = 0
        self._server: asyncio.Server | None = None
        #: While set: new connections are refused ("cut") or swallowed ("black hole").
        self.down: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.down == "cut":
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        link = _Link(writer, up_writer)
        if self.down == "black hole":
            link.holes.set()
        self.links.append(link)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(source, sink, link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while data := await source.read(65536):
                if link.holes.is_set():
                    continue  # swallowed: the other end never hears of it
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not link.holes.is_set():
                with contextlib.suppress(Exception):
                    sink.close()

    def black_hole(self) -> None:
        """Open connections go silent in both directions; their sockets stay open."""
        for link in self.links:
            link.holes.set()

    def cut(self) -> None:
        """Open connections are closed at once."""
        for link in self.links:
            for writer in (link.client, link.server):
                with contextlib.suppress(Exception):
                    writer.close()
        self.links.clear()

    async def outage(self, kind: str, seconds: float) -> None:
        """The link fails (``"cut"`` or ``"black hole"``) for ``seconds``, new connections
        included; then it works again."""
        self.down = kind
        self.cut() if kind == "cut" else self.black_hole()
        await asyncio.sleep(seconds)
        self.down = None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in self.links:
            for writer in (link.client, link.server):
                with contextlib.suppress(Exception):
                    writer.close()
        for task in list(self._tasks):
            task.cancel()
