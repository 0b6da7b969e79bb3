"""The guard in front of an RPC worker, across network namespaces the test creates: the
primary's namespace reaches the worker, a third namespace cannot, though both can route to it.
The worker stands in as a loopback echo server (the wiring to ggml-rpc-server is exercised by
the split-inference end-to-end tests)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest
import uvloop

from agent.rpc_guard import RpcGuard, peer_allowed
from tests.faults.services import free_port
from tests.security.netns import Namespace

#: Connects from inside a namespace, sends a payload, prints what comes back ("" when refused).
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
got = b""
try:
    s.sendall(b"x" * 300000)
    while len(got) < 300000:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
except OSError:
    pass
print(len(got))
"""


@pytest.fixture
def primary() -> Iterator[Namespace]:
    ns = Namespace.create(subnet=78)
    yield ns
    ns.delete()


@pytest.fixture
def stranger() -> Iterator[Namespace]:
    ns = Namespace.create(subnet=79)
    yield ns
    ns.delete()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _from(ns: Namespace, host: str, port: int) -> int:
    done = await asyncio.to_thread(
        subprocess.run,
        ns.command(sys.executable, "-c", CLIENT, host, str(port)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip() or 0)


async def _scenario(primary: Namespace, stranger: Namespace) -> tuple[int, int, int]:
    """Bytes echoed to the primary's namespace and to the stranger's, and refusals counted."""
    backend = await asyncio.start_server(_echo, "127.0.0.1", 0)
    # The worker's node is this namespace; it listens on its address towards the primary.
    port = free_port()
    guard = RpcGuard(primary.outside, port, ("127.0.0.1", backend.sockets[0].getsockname()[1]))
    guard.allow([primary.inside])
    await guard.start()
    try:
        allowed = await _from(primary, primary.outside, port)
        refused = await _from(stranger, primary.outside, port)  # routed there, but refused
        return allowed, refused, guard.refused
    finally:
        await guard.close()
        backend.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # the agent runs on uvloop
async def test_only_the_primarys_namespace_reaches_the_worker(
    primary: Namespace, stranger: Namespace, loop: str
) -> None:
    if loop == "uvloop":
        result = await asyncio.to_thread(uvloop.run, _scenario(primary, stranger))
    else:
        result = await _scenario(primary, stranger)
    assert result == (300000, 0, 1)  # every byte both ways for the primary; nothing else


def test_only_named_private_addresses_are_allowed() -> None:
    allowed = {"10.0.0.5", "127.0.0.1"}
    assert peer_allowed("10.0.0.5", allowed)
    assert peer_allowed("::ffff:10.0.0.5", allowed)  # IPv4-mapped
    assert not peer_allowed("10.0.0.6", allowed)
    assert not peer_allowed("8.8.8.8", {"8.8.8.8"})  # global: never, unless allowed
    assert peer_allowed("8.8.8.8", {"8.8.8.8"}, allow_public=True)
    assert not peer_allowed("not-an-address", allowed)
