"""The controller's own model store, served to nodes (interfaces/model_store_server.py): a node
fetches a stored file with its certificate and a ticket, verified against the controller's
certificate under ``dacp-controller``; a node revoked since its ticket was signed is refused,
by the store and by a peer node's file server (agent/models/model_transfers.py), whatever it holds.
Real TLS over loopback, real files."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.models.model_fetch import Source, TransferError, fetch, partial_path
from agent.models.model_transfers import ModelTransfers
from agent.node.node_tls import NodeTls
from common.model_file_server import ModelFileServer
from common.transfer_ticket import CONTROLLER_SOURCE_ID, Ticket, sign_ticket
from infrastructure.model_store import ControllerModelStore
from infrastructure.settings import Settings
from infrastructure.tls import ServerTls, issue_node_cert, load_or_create
from interfaces.model_store_server import start_store_server
from tests.integration.fake_control_plane import free_port
from wire import control_pb2 as pb

SIZE = 6 << 20


@dataclass
class Store:
    tls: ServerTls
    server: ModelFileServer
    sha256: str
    source_bytes: bytes
    node: str
    node_tls: NodeTls

    def ticket(self, node: str | None = None) -> str:
        assert self.tls.ca_key_pem is not None
        claims = Ticket(self.sha256, node or self.node, time.time() + 60)
        return sign_ticket(self.tls.ca_key_pem, claims)

    def source(self, ticket: str | None = None) -> Source:
        return Source(CONTROLLER_SOURCE_ID, "127.0.0.1", self.server.port, ticket or self.ticket())


def _identity(tmp: Path, tls: ServerTls, node_id: str) -> NodeTls:
    assert tls.ca_key_pem is not None
    node = NodeTls(tmp / node_id)
    csr = node.csr(node_id).encode()
    node.store(issue_node_cert(tls.ca_pem, tls.ca_key_pem, node_id, csr).decode())
    return node


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    settings = Settings(
        var_dir=tmp_path / "var", model_store_port=free_port(), grpc_host="127.0.0.1"
    )
    tls = load_or_create(settings.tls_dir)
    data = os.urandom(SIZE)
    original = tmp_path / "SmolModel.gguf"
    original.write_bytes(data)
    stored = ControllerModelStore(settings.model_store_dir).add(original)
    server = start_store_server(settings, tls, revoked=[])
    assert server is not None
    node = str(uuid.uuid4())
    yield Store(tls, server, stored.sha256, data, node, _identity(tmp_path, tls, node))
    server.stop()


def test_a_node_fetches_a_stored_model_from_the_controller(store: Store, tmp_path: Path) -> None:
    dest = tmp_path / "node-models" / "SmolModel.gguf"
    context = store.node_tls.client_context(store.tls.ca_pem.decode())
    fetch(store.source(), store.sha256, SIZE, dest, context)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == store.sha256
    assert dest.read_bytes() == store.source_bytes
    assert store.server.bytes_sent == SIZE


def test_a_node_verifies_the_store_is_the_controller(store: Store, tmp_path: Path) -> None:
    # The same server named as a node: its certificate is the controller's, not that node's.
    impostor = Source(str(uuid.uuid4()), "127.0.0.1", store.server.port, store.ticket())
    dest = tmp_path / "node-models" / "SmolModel.gguf"
    with pytest.raises(TransferError, match="cannot reach"):
        fetch(
            impostor,
            store.sha256,
            SIZE,
            dest,
            store.node_tls.client_context(store.tls.ca_pem.decode()),
        )
    assert store.server.bytes_sent == 0


def test_a_revoked_node_is_refused_by_the_store_despite_its_ticket(
    store: Store, tmp_path: Path
) -> None:
    ticket = store.ticket()  # signed before the revocation: still valid for minutes
    store.server.revoke([store.node])
    dest = tmp_path / "node-models" / "SmolModel.gguf"
    context = store.node_tls.client_context(store.tls.ca_pem.decode())
    with pytest.raises(TransferError, match="revoked") as refused:
        fetch(store.source(ticket), store.sha256, SIZE, dest, context)
    assert not refused.value.retry  # 403: no other attempt helps
    assert store.server.bytes_sent == 0
    assert not dest.exists() and not partial_path(dest).exists()


def test_an_unenrolled_client_cannot_download_from_the_store(store: Store, tmp_path: Path) -> None:
    stranger_ca = load_or_create(tmp_path / "stranger-tls")
    stranger = _identity(tmp_path / "stranger", stranger_ca, store.node)
    dest = tmp_path / "stranger-models" / "SmolModel.gguf"
    with pytest.raises(TransferError):
        fetch(
            store.source(),
            store.sha256,
            SIZE,
            dest,
            stranger.client_context(store.tls.ca_pem.decode()),
        )
    assert store.server.bytes_sent == 0


def test_the_store_is_not_served_without_the_controllers_own_ca(tmp_path: Path) -> None:
    settings = Settings(var_dir=tmp_path / "var", model_store_port=free_port())
    assert start_store_server(settings, None, revoked=[]) is None  # plaintext controller
    off = Settings(var_dir=tmp_path / "var", model_store_port=None)
    assert start_store_server(off, load_or_create(off.tls_dir), revoked=[]) is None


def test_a_node_file_server_refuses_nodes_the_controller_revoked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent side: NodesRevoked (and Welcome's list) reach the node's own file server."""
    tls = load_or_create(tmp_path / "tls")
    assert tls.ca_key_pem is not None
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    a_dir = tmp_path / "a"
    models = a_dir / "models"
    models.mkdir(parents=True)
    model = models / "m.gguf"
    model.write_bytes(os.urandom(1 << 20))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    transfers = ModelTransfers(models, a_dir, "127.0.0.1", free_port(), on_model_added=lambda: None)
    # The node holds the file (random bytes, not a GGUF its store would parse).
    monkeypatch.setattr(
        transfers.store, "cached_path", lambda wanted: model if wanted == sha else None
    )
    csr = transfers.csr(a).encode()
    cert = issue_node_cert(tls.ca_pem, tls.ca_key_pem, a, csr).decode()
    # Welcome: b was revoked while this node was away.
    transfers.welcomed(cert, tls.ca_pem.decode(), revoked_node_ids=[b])
    assert transfers.server is not None
    try:
        port = transfers.server.port

        def attempt(node: str) -> None:
            ticket = sign_ticket(tls.ca_key_pem or b"", Ticket(sha, node, time.time() + 60))
            fetch(
                Source(a, "127.0.0.1", port, ticket),
                sha,
                1 << 20,
                tmp_path / node / "m.gguf",
                _identity(tmp_path / "ids", tls, node).client_context(tls.ca_pem.decode()),
            )

        with pytest.raises(TransferError, match="revoked"):
            attempt(b)
        attempt(c)  # anyone else is served
        # NodesRevoked on the stream: c is refused from now on.
        message = pb.ControllerMessage(nodes_revoked=pb.NodesRevoked(node_ids=[c]))
        transfers.revoke(message.nodes_revoked.node_ids)
        with pytest.raises(TransferError, match="revoked"):
            attempt(c)
    finally:
        transfers.close()


def test_a_source_without_the_file_lets_the_fetch_try_the_next(
    store: Store, tmp_path: Path
) -> None:
    missing = "0" * 64  # e.g. unstored meanwhile: the store answers 404
    assert store.tls.ca_key_pem is not None
    ticket = sign_ticket(store.tls.ca_key_pem, Ticket(missing, store.node, time.time() + 60))
    dest = tmp_path / "node-models" / "Gone.gguf"
    context = store.node_tls.client_context(store.tls.ca_pem.decode())
    with pytest.raises(TransferError, match="404") as refused:
        fetch(store.source(ticket), missing, SIZE, dest, context)
    assert refused.value.retry  # agent/models/model_transfers.py goes on to the next source
