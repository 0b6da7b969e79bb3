"""Who may reach the agent's RPC worker (issue 21, finding 4), agent side, without llama.cpp:
the set the controller names replaces the one before, a revoked node's addresses leave it at
once and its open connections are closed, and the session hands ``RpcWorkerPeers`` and
``NodesRevoked`` to the handler. The copying guard runs on loopback in front of an echo server
(the real ``ggml-rpc-server`` is in tests/security/test_rpc_allow_list.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.rpc_filter import PeerSet
from agent.runtime.rpc_guard import RpcGuard
from agent.runtime.rpc_host import named_peers
from wire import control_pb2 as pb

LOOPBACK = ("127.0.0.0/8",)


def test_a_peer_set_is_exact_and_loses_a_revoked_nodes_addresses() -> None:
    peers = PeerSet.of(
        [("a", "10.0.0.5"), ("b", "::ffff:10.0.0.6"), ("c", "8.8.8.8"), ("d", "10.0.0.5")],
        ("10.0.0.0/8",),
        "w:1",
    )
    assert peers.addresses == {"10.0.0.5", "10.0.0.6"}  # 8.8.8.8 is outside the CIDRs
    assert peers.without_nodes(["b"]).addresses == {"10.0.0.5"}
    # Peers are told apart by address: a revoked node takes its address from everyone.
    assert peers.without_nodes(["a"]).addresses == {"10.0.0.6"}
    assert peers.without_nodes([""]).addresses == peers.addresses


def test_an_older_controllers_addresses_count_without_node_ids() -> None:
    access = [pb.RpcPeerAccess(node_id="a", address="10.0.0.5")]
    assert named_peers(access, ["10.0.0.5", "10.0.0.7"]) == [("a", "10.0.0.5"), ("", "10.0.0.7")]


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An echo server: the worker behind the guard."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(1024):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


@pytest.fixture
async def guard(echo: tuple[str, int]) -> AsyncIterator[RpcGuard]:
    gate = RpcGuard("127.0.0.1", 0, echo, cidrs=LOOPBACK)
    await gate.start()
    yield gate
    await gate.close()


def _connect(gate: RpcGuard) -> socket.socket:
    sock = socket.create_connection((gate.host, gate.port), timeout=5)
    return sock


def _served(sock: socket.socket) -> bool:
    """Whether the connection still reaches the worker (an echo), or was closed on it."""
    try:
        sock.sendall(b"x")
        return sock.recv(1) == b"x"
    except OSError:
        return False


async def _eventually_closed(sock: socket.socket) -> bool:
    return not await asyncio.to_thread(_served, sock)


async def _link_of_primary_a(guard: RpcGuard) -> socket.socket:
    """Admits only primary ``a`` (127.0.0.1) and opens a connection that the worker serves."""
    guard.admit_only([("a", "127.0.0.1")])
    held = await asyncio.to_thread(_connect, guard)
    assert await asyncio.to_thread(_served, held)
    return held


async def test_the_guard_replaces_its_set_and_closes_a_revoked_peers_connection(
    guard: RpcGuard,
) -> None:
    held = await _link_of_primary_a(guard)
    assert guard.connected() == {"127.0.0.1"}
    guard.admit_only([("b", "10.0.0.9")])  # another primary: new connections refused...
    fresh = await asyncio.to_thread(_connect, guard)
    assert await _eventually_closed(fresh)
    assert await asyncio.to_thread(_served, held)  # ...the open one is the caller's to close
    assert guard.disconnect(guard.connected() - guard.allowed) == 1
    assert await _eventually_closed(held)
    guard.admit_only([("a", "127.0.0.1")])
    assert guard.revoke(["a"]) == {"127.0.0.1"} and guard.allowed == frozenset()


@pytest.fixture
async def handler(tmp_path: Path, guard: RpcGuard) -> AsyncIterator[LlamaHandler]:
    fake = tmp_path / "bin"  # never executed here
    binaries = RuntimeBinaries(fake, fake / "llama-server", fake / "ggml-rpc-server")
    h = LlamaHandler(
        binaries,
        models_dir=tmp_path / "models",
        data_dir=tmp_path,
        log_dir=tmp_path / "logs",
        allowed_peer_cidrs=LOOPBACK,
    )
    h.rpc_host.guard = guard  # the worker's gate, as on_start_rpc_worker leaves it
    yield h
    h.rpc_host.guard = None
    await h.close()


async def _sent(message: pb.AgentMessage) -> None:
    raise AssertionError(f"nothing is answered: {message}")


async def test_a_job_ending_narrows_the_set_and_keeps_the_warm_link(
    handler: LlamaHandler, guard: RpcGuard
) -> None:
    held = await _link_of_primary_a(guard)
    await handler.on_rpc_worker_peers(pb.RpcWorkerPeers(reason="job ended"), _sent)
    assert guard.allowed == frozenset()
    assert await asyncio.to_thread(_served, held)  # the warm llama-server keeps its link
    fresh = await asyncio.to_thread(_connect, guard)
    assert await _eventually_closed(fresh)


async def test_a_revoked_primary_loses_its_connection_and_any_later_set(
    handler: LlamaHandler, guard: RpcGuard
) -> None:
    held = await _link_of_primary_a(guard)
    await handler.on_nodes_revoked(["a"])
    assert guard.allowed == frozenset()
    assert await _eventually_closed(held)
    # A controller that has not heard of the revocation yet names it again: left out.
    again = pb.RpcWorkerPeers(peers=[pb.RpcPeerAccess(node_id="a", address="127.0.0.1")])
    await handler.on_rpc_worker_peers(again, _sent)
    assert guard.allowed == frozenset()


class Recording(LlamaHandler):
    def __init__(self, tmp_path: Path) -> None:
        fake = tmp_path / "bin"
        binaries = RuntimeBinaries(fake, fake / "llama-server", fake / "ggml-rpc-server")
        super().__init__(
            binaries, models_dir=tmp_path / "models", data_dir=tmp_path, log_dir=tmp_path
        )
        self.revoked: list[list[str]] = []
        self.peer_sets: list[list[str]] = []

    async def on_nodes_revoked(self, node_ids: list[str]) -> None:  # type: ignore[override]
        self.revoked.append(list(node_ids))

    async def on_rpc_worker_peers(self, msg: pb.RpcWorkerPeers, send: object) -> None:  # type: ignore[override]
        self.peer_sets.append([p.address for p in msg.peers])


async def test_the_session_hands_revocations_and_peer_sets_to_the_handler(tmp_path: Path) -> None:
    handler = Recording(tmp_path)
    session = AgentSession(AgentConfig(data_dir=tmp_path, node_name="n"), handler)
    session.traffic.dispatch(pb.ControllerMessage(nodes_revoked=pb.NodesRevoked(node_ids=["x"])))
    peers = pb.RpcWorkerPeers(peers=[pb.RpcPeerAccess(node_id="p", address="10.0.0.2")])
    session.traffic.dispatch(pb.ControllerMessage(rpc_worker_peers=peers))

    async def both() -> None:
        while len(handler.revoked) + len(handler.peer_sets) < 2:
            await asyncio.sleep(0)

    await asyncio.wait_for(both(), 5)
    assert handler.revoked == [["x"]] and handler.peer_sets == [["10.0.0.2"]]
    assert "x" in session.transfers.revoked  # the model file server refuses it too
    await handler.close()
