"""Who reaches a node's RPC worker, across network namespaces the test creates: the real
``ggml-rpc-server`` started by the agent's handler (``StartRpcWorker``) answers the primary's
namespace, and a third namespace, which routes to it just as well, gets nothing. Both gates are
tested: the accept filter loaded into the worker (the default) and the copying guard (where
the filter was not built)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from agent.runtime.llama_binaries import find_binaries
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.rpc_filter import PeerFilter, peer_allowed
from agent.runtime.rpc_guard import RpcGuard
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime_errors import RuntimeStartError
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from tests.faults.services import free_port
from tests.security.netns import Namespace, namespace_fixture
from wire import control_pb2 as pb

#: From inside a namespace: the RPC protocol's HELLO (command 14, 24 bytes of capabilities);
#: prints the size of the worker's answer (28), or 0 when the connection is closed on it.
HELLO_CLIENT = """
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
got = b""
try:
    s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
    while len(got) < 8:
        chunk = s.recv(8 - len(got))
        if not chunk:
            break
        got += chunk
except OSError:
    pass
print(struct.unpack("<Q", got)[0] if len(got) == 8 else 0)
"""
HELLO_ANSWER_BYTES = 28


primary = namespace_fixture(78)


stranger = namespace_fixture(79)


async def _hello_from(ns: Namespace, host: str, port: int) -> int:
    done = await asyncio.to_thread(
        subprocess.run,
        ns.command(sys.executable, "-c", HELLO_CLIENT, host, str(port)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip() or 0)


def _handler(tmp_path: Path, *, accept_filter: bool) -> LlamaHandler:
    binaries = find_binaries()
    assert binaries.accept_filter is not None, "ops.build_llama builds the filter here"
    if not accept_filter:
        binaries = dataclasses.replace(binaries, accept_filter=None)
    return LlamaHandler(
        binaries,
        models_dir=tmp_path / "models",
        data_dir=tmp_path / "data",
        log_dir=tmp_path / "logs",
        rpc_threads=1,
    )


async def _scenario(
    tmp_path: Path, primary: Namespace, stranger: Namespace, *, accept_filter: bool
) -> tuple[list[int], type, str]:
    """HELLO answers for primary, stranger, primary again; the gate; the worker's log."""
    handler = _handler(tmp_path, accept_filter=accept_filter)
    sent: list[pb.AgentMessage] = []

    async def send(message: pb.AgentMessage) -> None:
        sent.append(message)

    # The worker's node is this namespace: it listens on its address towards the primary.
    port = free_port()
    start = pb.StartRpcWorker(
        job_id="job-1", host=primary.outside, port=port, allowed_peers=[primary.inside]
    )
    try:
        await handler.on_start_rpc_worker(start, send)
        status = sent[-1].rpc_worker_status
        assert status.state == pb.RpcWorkerStatus.STARTED, status.error
        assert (status.host, status.port) == (primary.outside, port)
        answers = [
            await _hello_from(primary, primary.outside, port),
            await _hello_from(stranger, primary.outside, port),  # routed there, but refused
            await _hello_from(primary, primary.outside, port),  # and the primary still served
        ]
        worker = handler.rpc_worker
        assert worker is not None
        return answers, type(handler.rpc_host.guard), worker.log_text()
    finally:
        await handler.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # the agent runs on uvloop
async def test_the_accept_filter_lets_only_the_primarys_namespace_reach_the_worker(
    tmp_path: Path, primary: Namespace, stranger: Namespace, loop: str
) -> None:
    scenario = _scenario(tmp_path, primary, stranger, accept_filter=True)
    if loop == "uvloop":
        answers, gate, log = await asyncio.to_thread(uvloop.run, scenario)
    else:
        answers, gate, log = await scenario
    assert gate is PeerFilter
    assert answers == [HELLO_ANSWER_BYTES, 0, HELLO_ANSWER_BYTES]
    assert f"dacp-rpc-filter: refused a connection from {stranger.inside}" in log


async def test_the_copying_guard_lets_only_the_primarys_namespace_reach_the_worker(
    tmp_path: Path, primary: Namespace, stranger: Namespace
) -> None:
    answers, gate, _ = await _scenario(tmp_path, primary, stranger, accept_filter=False)
    assert gate is RpcGuard
    assert answers == [HELLO_ANSWER_BYTES, 0, HELLO_ANSWER_BYTES]


def test_a_worker_whose_filter_did_not_load_is_stopped_not_used(tmp_path: Path) -> None:
    binaries = find_binaries()
    not_a_library = tmp_path / "libnot-a-filter.so"
    not_a_library.write_text("not an ELF file")  # the loader skips it and runs the worker
    gate = PeerFilter(
        "127.0.0.1", free_port(), not_a_library, tmp_path / "peers", DEFAULT_ALLOWED_PEER_CIDRS
    )
    worker = RpcWorker(
        binaries, gate.host, gate.port, log_dir=tmp_path, threads=1, accept_filter=gate
    )
    with pytest.raises(RuntimeStartError, match="is not loaded in the worker"):
        worker.start(timeout=30)
    assert not worker.alive


async def test_only_named_addresses_inside_the_agents_cidrs_are_written(tmp_path: Path) -> None:
    peers = tmp_path / "rpc" / "peers"
    gate = PeerFilter("10.0.0.1", 50052, Path("/unused.so"), peers, ("10.0.0.0/8",))
    assert peers.read_text() == ""  # nobody before the controller names a primary
    named = ["10.0.0.5", "::ffff:10.0.0.6", "192.168.1.9", "8.8.8.8", "not-an-address"]
    gate.admit_only(("node", address) for address in named)
    assert peers.read_text().splitlines() == ["10.0.0.5", "10.0.0.6"]
    gate.admit_only([("b", "10.0.0.7")])  # the exact set replaces the one before
    assert peers.read_text().splitlines() == ["10.0.0.7"]
    await gate.close()
    assert not peers.exists()


def test_the_agents_cidrs_decide() -> None:
    assert peer_allowed("10.0.0.5", DEFAULT_ALLOWED_PEER_CIDRS)
    assert peer_allowed("::ffff:192.168.1.5", DEFAULT_ALLOWED_PEER_CIDRS)  # IPv4-mapped
    assert not peer_allowed("8.8.8.8", DEFAULT_ALLOWED_PEER_CIDRS)  # global: not by default
    assert peer_allowed("8.8.8.8", ("8.8.8.0/24",))  # unless the operator says so
    assert not peer_allowed("not-an-address", DEFAULT_ALLOWED_PEER_CIDRS)
