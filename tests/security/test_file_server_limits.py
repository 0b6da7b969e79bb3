"""Model file servers under a connection flood (issue 21, finding 6): the controller's model store
(``MODEL_STORE_PORT``) of a real controller process, the same server every agent runs on its
``--transfer-port`` (common/model_file_server.py).

Hundreds of idle TCP connections from many addresses, and some that stall half-way through the
TLS handshake, cost the server no thread each: its thread count stays bounded, they are closed
once the handshake timeout passes, one address gets only its share of connections, a node that
shakes hands and never sends its request is cut as well, and a legitimate fetch with a valid
ticket succeeds throughout. Everything on loopback (127.0.0.0/8 gives the test many source
addresses)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from agent.models.model_fetch import Source, fetch
from agent.node.node_tls import NodeTls
from common.model_file_server import ModelFileServer, ServerLimits
from common.transfer_ticket import CONTROLLER_SOURCE_ID, Ticket, sign_ticket, source_tls_name
from infrastructure.model_store import ControllerModelStore
from infrastructure.tls import issue_node_cert, load_or_create
from tests.faults.services import free_port

REPO = Path(__file__).resolve().parents[2]
SIZE = 8 << 20
#: What the test configures (MODEL_STORE_HANDSHAKE_TIMEOUT, _WORKERS, _CONNECTIONS_PER_ADDRESS).
HANDSHAKE_TIMEOUT = 2.0
WORKERS = 4
PER_ADDRESS = 4
#: Idle connections: 50 addresses, each within its share.
FLOOD_ADDRESSES = 50

pytestmark = pytest.mark.timeout(120)


@dataclass
class Store:
    """A controller process serving its model store, and what a node needs to fetch from it."""

    process: subprocess.Popen[bytes]
    port: int
    ca_pem: str
    ca_key_pem: bytes
    sha256: str
    data: bytes

    def threads(self) -> int:
        return psutil.Process(self.process.pid).num_threads()

    def node(self, tmp: Path) -> tuple[str, NodeTls]:
        """A node identity with a certificate the controller's CA issued."""
        node_id = str(uuid.uuid4())
        tls = NodeTls(tmp / node_id)
        cert = issue_node_cert(
            self.ca_pem.encode(), self.ca_key_pem, node_id, tls.csr(node_id).encode()
        )
        tls.store(cert.decode())
        return node_id, tls

    def fetch(self, tmp: Path) -> Path:
        node_id, tls = self.node(tmp)
        ticket = sign_ticket(self.ca_key_pem, Ticket(self.sha256, node_id, time.time() + 60))
        dest = tmp / f"fetched-{node_id[:8]}" / "model.gguf"
        source = Source(CONTROLLER_SOURCE_ID, "127.0.0.1", self.port, ticket)
        return fetch(source, self.sha256, SIZE, dest, tls.client_context(self.ca_pem), timeout=10)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    var = tmp_path / "var"
    original = tmp_path / "model.gguf"
    data = os.urandom(SIZE)
    original.write_bytes(data)
    stored = ControllerModelStore(var / "models").add(original)
    port, store_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(free_port()),
        "MODEL_STORE_PORT": str(store_port),
        "MODEL_STORE_HANDSHAKE_TIMEOUT": str(HANDSHAKE_TIMEOUT),
        "MODEL_STORE_WORKERS": str(WORKERS),
        "MODEL_STORE_CONNECTIONS_PER_ADDRESS": str(PER_ADDRESS),
        "ADMIN_API_KEY": "test-admin-key",
        "AI_API_KEY": "test-ai-key",
        "NODE_ENROLLMENT_SECRET": "test-enrollment-secret",
        "DACP_VAR_DIR": str(var),
    }
    log_path = tmp_path / "controller.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "interfaces.cli.main", "controller"],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        ca = var / "tls" / "ca.pem"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):  # plain HTTP on loopback
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield Store(
            proc,
            store_port,
            ca.read_text(),
            (var / "tls" / "ca.key").read_bytes(),
            stored.sha256,
            data,
        )
    finally:
        proc.terminate()
        proc.wait(30)


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _half_client_hello() -> bytes:
    """The first half of a real TLS ClientHello: a handshake that stalls where it started."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="x")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    return hello[: len(hello) // 2]


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (EOF or reset waits to be read)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""
    except (ssl.SSLWantReadError, BlockingIOError):  # a TLS session ticket, not the end
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _wait_closed(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets still open after ``timeout`` (the others closed meanwhile)."""
    deadline = time.monotonic() + timeout
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        select.select(open_, [], [], 0.1)
        open_ = [s for s in open_ if not _closed(s)]
    return open_


def test_idle_and_stalled_connections_cost_no_thread_and_are_closed(
    store: Store, tmp_path: Path
) -> None:
    store.fetch(tmp_path)  # the server's workers are up: the baseline counts them
    baseline = store.threads()
    hello = _half_client_hello()
    flood: list[socket.socket] = []
    stalled: list[socket.socket] = []
    try:
        flood_started = time.monotonic()
        for i in range(FLOOD_ADDRESSES):
            for _ in range(PER_ADDRESS):
                flood.append(_connect(store.port, f"127.0.1.{i + 1}"))
        for i in range(10):
            sock = _connect(store.port, f"127.0.2.{i + 1}")
            sock.sendall(hello)
            stalled.append(sock)

        # A legitimate fetch, with a valid ticket, succeeds in the middle of the flood.
        fetched: list[Path] = []
        fetcher = threading.Thread(target=lambda: fetched.append(store.fetch(tmp_path)))
        fetcher.start()
        peak = baseline
        while fetcher.is_alive() or time.monotonic() - flood_started < 1.0:
            peak = max(peak, store.threads())
            time.sleep(0.05)
        fetcher.join()
        assert fetched and hashlib.sha256(fetched[0].read_bytes()).hexdigest() == store.sha256
        # 210 connections held open: no thread each (the most the server adds is its workers).
        assert peak <= baseline + WORKERS, (
            f"{len(flood) + len(stalled)} idle connections took the server from {baseline} "
            f"to {peak} threads"
        )

        # Every one is closed once the handshake timeout has passed.
        left = _wait_closed(flood + stalled, HANDSHAKE_TIMEOUT + 5)
        waited = time.monotonic() - flood_started
        assert not left, (
            f"{len(left)} of {len(flood) + len(stalled)} idle connections still open after "
            f"{waited:.1f} s (handshake timeout {HANDSHAKE_TIMEOUT} s)"
        )
        assert store.threads() <= baseline + WORKERS
    finally:
        for sock in flood + stalled:
            sock.close()


def test_one_address_gets_only_its_share_of_connections(store: Store, tmp_path: Path) -> None:
    socks = [_connect(store.port, "127.0.3.1") for _ in range(PER_ADDRESS + 16)]
    try:
        # Well before the handshake timeout, all but PER_ADDRESS have been closed.
        time.sleep(0.2)
        left = _wait_closed(socks, HANDSHAKE_TIMEOUT / 2)
        assert len(left) <= PER_ADDRESS, (
            f"{len(left)} connections from one address held open (its share: {PER_ADDRESS})"
        )
        # Another address is served meanwhile.
        fetched = store.fetch(tmp_path)
        assert fetched.read_bytes() == store.data
    finally:
        for sock in socks:
            sock.close()


def test_a_node_that_never_sends_its_request_is_cut(store: Store, tmp_path: Path) -> None:
    _, tls = store.node(tmp_path)
    context = tls.client_context(store.ca_pem)
    silent: list[socket.socket] = []
    try:
        for i in range(WORKERS + 2):  # more than the workers: they must not all be held
            raw = _connect(store.port, f"127.0.4.{i + 1}")
            silent.append(context.wrap_socket(raw, server_hostname="dacp-controller"))
        started = time.monotonic()
        fetched = store.fetch(tmp_path)  # still served
        assert fetched.read_bytes() == store.data
        left = _wait_closed(silent, HANDSHAKE_TIMEOUT + 5)
        assert not left, (
            f"{len(left)} connections that sent no request still open after "
            f"{time.monotonic() - started:.1f} s"
        )
    finally:
        for sock in silent:
            sock.close()


def test_a_node_that_reads_a_trickle_is_cut(tmp_path: Path) -> None:
    """A fetcher with a valid ticket that reads a trickle (16 KiB every 0.2 s) holds its worker
    for about one send timeout per MiB (a real server with a 1 s one; the default is 60 s)."""
    ca = load_or_create(tmp_path / "tls")
    assert ca.ca_key_pem is not None
    ca_pem, ca_key = ca.ca_pem.decode(), ca.ca_key_pem
    holder, reader = str(uuid.uuid4()), str(uuid.uuid4())
    data = os.urandom(32 << 20)  # more than the socket buffers hold
    held = tmp_path / "model.gguf"
    held.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    server_tls = NodeTls(tmp_path / holder)
    cert = issue_node_cert(ca.ca_pem, ca_key, holder, server_tls.csr(holder).encode())
    server_tls.store(cert.decode())
    server = ModelFileServer(
        "127.0.0.1",
        0,
        server_tls.server_context(ca_pem),
        ca_pem,
        lambda wanted: held if wanted == sha else None,
        ServerLimits(send_timeout=1.0),
    ).start()
    ticket = sign_ticket(ca_key, Ticket(sha, reader, time.time() + 60))
    try:
        client = NodeTls(tmp_path / reader)
        cert = issue_node_cert(ca.ca_pem, ca_key, reader, client.csr(reader).encode())
        client.store(cert.decode())
        raw = _connect(server.port, "127.0.5.1")
        sock = client.client_context(ca_pem).wrap_socket(
            raw, server_hostname=source_tls_name(holder)
        )
        request = f"GET /models/{sha} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ticket}\r\n\r\n"
        sock.sendall(request.encode())
        started = time.monotonic()
        got = 0
        while server.connections() and time.monotonic() - started < 15:
            got += len(sock.recv(16 << 10))
            time.sleep(0.2)
        took = time.monotonic() - started
        assert server.connections() == 0, (
            f"a trickle reader still holds its worker after {took:.1f} s"
        )
        assert took < 5, f"cut after {took:.1f} s"
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        assert got < len(data)  # cut, not finished
        sock.close()
    finally:
        server.stop()
