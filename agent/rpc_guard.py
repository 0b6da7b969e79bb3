"""The guard in front of an RPC worker: ``ggml-rpc-server`` has no authentication (and a history
of memory-safety bugs), so it listens on loopback only, and this guard listens where peers
reach it (the node's LAN address and RPC port). It accepts a connection only from an address
the controller named (the primary whose llama-server uses the worker), and never a globally
routable one (unless the agent allows public RPC); every other connection is closed at once.
Accepted bytes are copied both ways by asyncio protocols (no thread, no per-chunk task), with
flow control so neither side can make the agent buffer without bound.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from typing import cast

log = logging.getLogger(__name__)

#: Bytes buffered towards one side before reading from the other pauses.
HIGH_WATER = 4 * 1024 * 1024


def peer_allowed(address: str, allowed: set[str], *, allow_public: bool = False) -> bool:
    """Whether a connection from ``address`` may reach the worker."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_global and not allow_public:  # the rule the worker's own bind address follows
        return False
    return str(ip) in allowed


class _Pipe(asyncio.Protocol):
    """One side of a forwarded connection: what it receives goes to ``peer``'s transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.closed = asyncio.get_running_loop().create_future()
        #: What arrived before the other side was connected (sent once it is).
        self.pending: list[bytes] = []
        self.pending_eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport: no isinstance).
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:  # the backend is still connecting (uvloop starts reading at once, paused or not)
            self.pending.append(data)

    def eof_received(self) -> bool | None:
        peer = self.peer
        if peer is None:
            self.pending_eof = True
            return True
        if peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
            return True  # keep our side open until the peer closes too
        return None

    def join(self, peer: _Pipe) -> None:
        """Connects this side to ``peer`` and sends what arrived meanwhile."""
        self.peer = peer
        assert peer.transport is not None
        for data in self.pending:
            peer.transport.write(data)
        self.pending.clear()
        if self.pending_eof and peer.transport.can_write_eof():
            peer.transport.write_eof()

    def pause_writing(self) -> None:  # our buffer is full: stop reading the other side
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.close()


class RpcGuard:
    """Listens on ``host:port``; forwards allowed connections to ``backend`` (loopback)."""

    def __init__(
        self,
        host: str,
        port: int,
        backend: tuple[str, int],
        *,
        allow_public: bool = False,
    ) -> None:
        self.host, self.port, self.backend = host, port, backend
        self.allow_public = allow_public
        #: The addresses that may connect (the primaries using the worker).
        self.allowed: set[str] = set()
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[_Pipe] = set()
        self._connecting: set[asyncio.Future[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def allow(self, addresses: list[str] | tuple[str, ...]) -> None:
        self.allowed.update(addresses)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accepted, self.host, self.port)

    def _accepted(self) -> _Pipe:
        pipe = _Pipe()
        original = pipe.connection_made

        def made(base: asyncio.BaseTransport) -> None:
            original(base)
            transport = cast(asyncio.Transport, base)
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if peer else ""
            if not peer_allowed(address, self.allowed, allow_public=self.allow_public):
                self.refused += 1
                log.warning(
                    "RPC worker %s: refused a connection from %s (allowed: %s)",
                    self.endpoint,
                    address or "?",
                    ", ".join(sorted(self.allowed)) or "nobody",
                )
                transport.abort()
                return
            self._pipes.add(pipe)
            pipe.closed.add_done_callback(lambda _: self._pipes.discard(pipe))
            task = asyncio.ensure_future(self._connect_backend(pipe, transport))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

        pipe.connection_made = made  # type: ignore[method-assign, assignment]
        return pipe

    async def _connect_backend(self, front: _Pipe, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, back = await loop.create_connection(_Pipe, *self.backend)
        except OSError as e:
            log.warning("RPC worker %s: backend %s unreachable: %s", self.endpoint, self.backend, e)
            transport.abort()
            return
        if front.closed.done():  # the client left meanwhile
            if back.transport is not None:
                back.transport.close()
            return
        back.peer = front
        front.join(back)

    async def close(self) -> None:
        for pipe in list(self._pipes):
            if pipe.transport is not None:
                pipe.transport.abort()
            if pipe.peer is not None and pipe.peer.transport is not None:
                pipe.peer.transport.abort()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
