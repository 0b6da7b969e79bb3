"""The copying guard in front of an RPC worker, used where the worker's accept filter
(:mod:`agent.runtime.rpc_filter`) cannot be: ``ggml-rpc-server`` has no authentication (and a
history of memory-safety bugs), so it listens on loopback only, and this guard listens where peers
reach it (the node's LAN address and RPC port). It accepts a connection only from an address
the controller named (the primary whose llama-server uses the worker) that is inside the
agent's ``ALLOWED_PEER_CIDRS``; every other connection is closed at once.
Accepted bytes are copied both ways by two threads per connection, outside the agent's event
loop and without the GIL: ``os.splice`` moves them socket to pipe to socket inside the kernel
(Linux; other systems copy through a buffer). An RPC round trip per token crosses the guard
twice, so it must cost microseconds: copying in the event loop cost 7 % of split decode, these
threads about 5 % (the accept filter costs nothing).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Sequence

from agent.runtime.rpc_filter import NamedPeer, PeerGate, PeerSet, canonical

log = logging.getLogger(__name__)

#: Bytes moved per splice (or copy) call.
CHUNK = 1 << 20


def _listed(address: str, allowed: frozenset[str]) -> bool:
    try:
        return canonical(address) in allowed
    except ValueError:
        return False


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copies ``source`` to ``sink`` until EOF or an error, then half-closes ``sink``."""
    try:
        if hasattr(os, "splice"):
            read_end, write_end = os.pipe()
            try:
                while True:
                    moved = os.splice(source.fileno(), write_end, CHUNK)
                    if moved == 0:
                        break
                    while moved:
                        moved -= os.splice(read_end, sink.fileno(), moved)
            finally:
                os.close(read_end)
                os.close(write_end)
        else:
            while data := source.recv(CHUNK):
                sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


class RpcGuard(PeerGate):
    """Listens on ``host:port``; forwards allowed connections to ``backend`` (loopback)."""

    def __init__(
        self,
        host: str,
        port: int,
        backend: tuple[str, int],
        *,
        cidrs: Sequence[str],
    ) -> None:
        super().__init__(host, port, cidrs)
        self.backend = backend
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        #: Accepted connections: client socket → (peer address, backend socket).
        self._clients: dict[socket.socket, tuple[str, socket.socket]] = {}
        self._closed = False

    def admit_only(self, peers: Iterable[NamedPeer]) -> None:
        """From now on exactly ``peers`` may connect (an address outside the agent's CIDRs is
        refused, logged); whoever was let in before and is not named is refused."""
        admitted = PeerSet.of(peers, self.cidrs, self.endpoint)
        with self._lock:
            self.peers = admitted

    def revoke(self, node_ids: Iterable[str]) -> frozenset[str]:
        """Refuses the addresses named for ``node_ids`` at once; returns them."""
        with self._lock:
            before = self.peers.addresses
            self.peers = self.peers.without_nodes(node_ids)
            return before - self.peers.addresses

    def connected(self) -> set[str]:
        """The addresses with a connection open through the guard."""
        with self._lock:
            return {address for address, _ in self._clients.values()}

    def disconnect(self, addresses: Iterable[str]) -> int:
        """Closes every open connection from ``addresses``; returns how many."""
        gone = set(addresses)
        with self._lock:
            doomed = [(c, b) for c, (a, b) in self._clients.items() if a in gone]
        for client, backend in doomed:
            for sock in (client, backend):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        return len(doomed)

    async def start(self) -> None:
        listener = socket.create_server((self.host, self.port), backlog=64)
        if self.port == 0:
            self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._thread = threading.Thread(
            target=self._accept_forever, name=f"rpc-guard-{self.port}", daemon=True
        )
        self._thread.start()

    def _accept_forever(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed:
            try:
                client, peer = listener.accept()
            except OSError:
                return  # closed
            address = str(peer[0])
            with self._lock:
                allowed = self.peers.addresses
            if not _listed(address, allowed):
                log.warning(
                    "RPC worker %s: refused a connection from %s (allowed: %s)",
                    self.endpoint,
                    address,
                    ", ".join(sorted(allowed)) or "nobody",
                )
                client.close()
                continue
            try:
                backend = socket.create_connection(self.backend, timeout=5)
            except OSError as e:
                log.warning("RPC worker %s: backend unreachable: %s", self.endpoint, e)
                client.close()
                continue
            backend.settimeout(None)
            for sock in (client, backend):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                # Checked again where a revocation is seen: one that came meanwhile wins.
                still = _listed(address, self.peers.addresses)
                if still:
                    self._open.update((client, backend))
                    self._clients[client] = (canonical(address), backend)
            if not still:
                client.close()
                backend.close()
                continue
            threading.Thread(
                target=self._serve, args=(client, backend), name="rpc-guard-pump", daemon=True
            ).start()

    def _serve(self, client: socket.socket, backend: socket.socket) -> None:
        back = threading.Thread(target=_pump, args=(backend, client), daemon=True)
        back.start()
        _pump(client, backend)
        back.join()
        for sock in (client, backend):
            sock.close()
        with self._lock:
            self._open.difference_update((client, backend))
            self._clients.pop(client, None)

    async def close(self) -> None:
        self._closed = True
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            open_sockets = list(self._open)
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 5)
