"""Model files between nodes: node A serves a file it holds (common/model_file_server.py), node B
fetches it (agent/models/model_fetch.py), both with certificates the controller's CA issued them,
B with a ticket the controller signed. Real TLS over loopback, real files; a full disk is a
real tmpfs the test mounts."""

from __future__ import annotations

import hashlib
import os
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.models.model_fetch import PARTIAL_SUFFIX, Source, TransferError, fetch, partial_path
from agent.node.node_tls import NodeTls
from bench.model_transfer import node_identity, serve_file
from common.model_file_server import ModelFileServer
from common.model_sources import parse_cidrs
from common.transfer_ticket import Ticket, TicketError, sign_ticket, verify_ticket
from infrastructure.tls import issue_server_cert, load_or_create
from tests.transfer.http_sources import SERVE, http_source

SIZE = 24 << 20
#: The url sources here are on loopback: what MODEL_SOURCE_ALLOWED_CIDRS=127.0.0.0/8,::1 allows.
LOOPBACK = parse_cidrs(["127.0.0.0/8", "::1/128"])


@dataclass
class Pair:
    """The controller's CA, node A serving ``path``, node B's TLS identity."""

    ca_pem: str
    ca_key_pem: bytes
    a: str
    b: str
    b_tls: NodeTls
    server: ModelFileServer
    path: Path
    sha256: str

    def ticket(self, node: str | None = None, *, ttl: float = 60.0, sha: str = "") -> str:
        claims = Ticket(sha or self.sha256, node or self.b, time.time() + ttl)
        return sign_ticket(self.ca_key_pem, claims)

    def source(self, ticket: str | None = None) -> Source:
        return Source(self.a, "127.0.0.1", self.server.port, ticket or self.ticket())


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    controller = load_or_create(tmp_path / "tls")
    assert controller.ca_key_pem is not None
    ca_pem, ca_key = controller.ca_pem, controller.ca_key_pem
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    a_tls = node_identity(tmp_path, ca_pem, ca_key, a)
    b_tls = node_identity(tmp_path, ca_pem, ca_key, b)
    model = tmp_path / "a-models" / "model.gguf"
    model.parent.mkdir()
    model.write_bytes(os.urandom(SIZE))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    server = serve_file(a_tls, ca_pem, model, sha)
    yield Pair(ca_pem.decode(), ca_key, a, b, b_tls, server, model, sha)
    server.stop()


def test_a_node_fetches_a_model_whole_and_verified(pair: Pair, tmp_path: Path) -> None:
    dest = tmp_path / "b-models" / "model.gguf"
    seen: list[int] = []
    fetch(
        pair.source(),
        pair.sha256,
        SIZE,
        dest,
        pair.b_tls.client_context(pair.ca_pem),
        progress=lambda held, _: seen.append(held),
    )
    assert dest.read_bytes() == pair.path.read_bytes()
    assert not partial_path(dest).exists()
    assert seen[-1] == SIZE and seen == sorted(seen)


def test_a_cut_transfer_resumes_where_it_stopped(pair: Pair, tmp_path: Path) -> None:
    dest = tmp_path / "b-models" / "model.gguf"
    dest.parent.mkdir()
    # A transfer cut after 10 MiB left this behind.
    partial_path(dest).write_bytes(pair.path.read_bytes()[: 10 << 20])
    fetch(pair.source(), pair.sha256, SIZE, dest, pair.b_tls.client_context(pair.ca_pem))
    assert dest.read_bytes() == pair.path.read_bytes()
    assert pair.server.bytes_sent == SIZE - (10 << 20)  # only the rest crossed the link


def test_a_corrupted_byte_is_detected_and_the_file_fetched_again(
    pair: Pair, tmp_path: Path
) -> None:
    dest = tmp_path / "b-models" / "model.gguf"
    dest.parent.mkdir()
    damaged = bytearray(pair.path.read_bytes()[: 8 << 20])
    damaged[12345] ^= 0xFF  # what an earlier source (one that lied, say) left behind
    partial_path(dest).write_bytes(bytes(damaged))
    context = pair.b_tls.client_context(pair.ca_pem)
    # The resumed file does not match: the partial file goes, and this source starts over.
    fetch(pair.source(), pair.sha256, SIZE, dest, context)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == pair.sha256
    assert pair.server.bytes_sent == (SIZE - (8 << 20)) + SIZE


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_model_that_does_not_fit_fails_clearly_and_leaves_nothing(
    pair: Pair, small_disk: Path
) -> None:
    dest = small_disk / "model.gguf"
    partial_path(dest).write_bytes(pair.path.read_bytes()[: 1 << 20])  # an earlier attempt
    with pytest.raises(TransferError, match=r"needs .* more bytes; the models disk has") as failed:
        fetch(pair.source(), pair.sha256, SIZE, dest, pair.b_tls.client_context(pair.ca_pem))
    assert not failed.value.retry
    assert os.listdir(small_disk) == []
    assert pair.server.bytes_sent == 0


def _refused(pair: Pair, source: Source, tls: NodeTls, tmp_path: Path) -> TransferError:
    dest = tmp_path / f"refused-{uuid.uuid4().hex[:6]}" / "model.gguf"
    with pytest.raises(TransferError) as refused:
        fetch(source, pair.sha256, SIZE, dest, tls.client_context(pair.ca_pem))
    assert not dest.exists() and not any(dest.parent.glob("*" + PARTIAL_SUFFIX + "*"))
    return refused.value


def test_only_the_node_a_ticket_names_may_download(pair: Pair, tmp_path: Path) -> None:
    other = pair.ticket(node=str(uuid.uuid4()))  # a ticket for another node
    assert "another model or node" in str(_refused(pair, pair.source(other), pair.b_tls, tmp_path))
    expired = pair.ticket(ttl=-1)
    assert "expired" in str(_refused(pair, pair.source(expired), pair.b_tls, tmp_path))
    forged = pair.ticket()[:-4] + "AAAA"
    assert "not a ticket" in str(_refused(pair, pair.source(forged), pair.b_tls, tmp_path))
    wrong_model = pair.ticket(sha="0" * 64)
    assert "another model" in str(_refused(pair, pair.source(wrong_model), pair.b_tls, tmp_path))
    assert pair.server.bytes_sent == 0


def test_a_client_without_a_certificate_from_the_ca_cannot_connect(
    pair: Pair, tmp_path: Path
) -> None:
    # Its own CA: a certificate that looks right, issued by someone else.
    stranger_ca = load_or_create(tmp_path / "stranger-tls")
    assert stranger_ca.ca_key_pem is not None
    stranger = node_identity(tmp_path, stranger_ca.ca_pem, stranger_ca.ca_key_pem, pair.b)
    context = stranger.client_context(pair.ca_pem)  # it trusts the real CA for the server
    dest = tmp_path / "stranger" / "model.gguf"
    with pytest.raises(TransferError):
        fetch(pair.source(), pair.sha256, SIZE, dest, context)
    bare = ssl.create_default_context(cadata=pair.ca_pem)  # no client certificate at all
    with pytest.raises(TransferError):
        fetch(pair.source(), pair.sha256, SIZE, dest, bare)
    assert pair.server.bytes_sent == 0 and not dest.exists()


def test_a_server_that_is_not_the_named_node_is_refused(pair: Pair, tmp_path: Path) -> None:
    impostor = Source(str(uuid.uuid4()), "127.0.0.1", pair.server.port, pair.ticket())
    assert "cannot reach" in str(_refused(pair, impostor, pair.b_tls, tmp_path))


def test_tickets_verify_only_with_the_signing_ca(pair: Pair, tmp_path: Path) -> None:
    ticket = pair.ticket()
    assert verify_ticket(ticket, pair.ca_pem.encode(), time.time()).node_id == pair.b
    other = load_or_create(tmp_path / "other-tls")
    with pytest.raises(TicketError):
        verify_ticket(ticket, other.ca_pem, time.time())


class _RangeFiles(BaseHTTPRequestHandler):
    """A plain HTTP file server of the operator's network, with byte ranges."""

    protocol_version = "HTTP/1.1"
    path_to_file: Path

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        data = self.path_to_file.read_bytes()
        start = 0
        if wanted := self.headers.get("Range"):
            start = int(wanted.removeprefix("bytes=").removesuffix("-"))
            self.send_response(206)
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


@pytest.fixture
def url_server(pair: Pair) -> Iterator[str]:
    handler = type("Files", (_RangeFiles,), {"path_to_file": pair.path})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/models/model.gguf"
    server.shutdown()
    server.server_close()


def test_a_model_is_fetched_from_an_http_source_its_size_learnt_and_resumed(
    pair: Pair, url_server: str, tmp_path: Path
) -> None:
    dest = tmp_path / "b-models" / "model.gguf"
    dest.parent.mkdir()
    partial_path(dest).write_bytes(pair.path.read_bytes()[: 5 << 20])  # a cut attempt
    source = Source("", "", 0, "", url_server)
    context = pair.b_tls.client_context(pair.ca_pem)
    fetch(source, pair.sha256, 0, dest, context, allowed=LOOPBACK)
    assert dest.read_bytes() == pair.path.read_bytes()
    bad = Source("", "", 0, "", "http://127.0.0.1:99999/model.gguf")  # no such port
    with pytest.raises(TransferError, match="cannot reach"):
        fetch(
            bad,
            pair.sha256,
            0,
            tmp_path / "c" / "model.gguf",
            ssl.create_default_context(),
            allowed=LOOPBACK,
        )
    # A source whose own bytes do not match fails (the next may not), leaving nothing behind.
    other = tmp_path / "e" / "model.gguf"
    with pytest.raises(TransferError, match="does not match its sha256") as failed:
        fetch(source, "0" * 64, 0, other, context, allowed=LOOPBACK)
    assert failed.value.retry and not other.exists() and not partial_path(other).exists()
    # Without the operator's word, a source on loopback is not even connected to.
    again = tmp_path / "d" / "model.gguf"
    with pytest.raises(TransferError, match=r"loopback address.*MODEL_SOURCE_ALLOWED_CIDRS"):
        fetch(source, pair.sha256, 0, again, context)
    assert not again.exists() and not partial_path(again).exists()


def test_an_https_source_is_verified_under_its_host_at_the_address_checked(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """https against the system's CAs (here the test's CA, as SSL_CERT_FILE), the name
    verified being the URL's host although the connection goes to the address resolved."""
    tls = load_or_create(tmp_path / "https-ca")
    assert tls.ca_key_pem is not None
    cert, key = issue_server_cert(tls.ca_pem, tls.ca_key_pem, ["localhost"], ["127.0.0.1"])
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca_file))
    data = pair.path.read_bytes()
    with http_source(data, SERVE, server) as source:
        for host in ("127.0.0.1", "localhost"):
            url = f"https://{host}:{source.port}/models/model.gguf"
            dest = tmp_path / host / "model.gguf"
            fetch(
                Source("", "", 0, "", url),
                pair.sha256,
                0,
                dest,
                ssl.create_default_context(),
                allowed=LOOPBACK,
            )
            assert dest.read_bytes() == data
        assert source.requests == 2
        # A name the certificate does not carry is refused (verified, not just encrypted).
        other = f"https://127.0.0.2:{source.port}/models/model.gguf"
        with pytest.raises(TransferError, match="cannot reach"):
            fetch(
                Source("", "", 0, "", other),
                pair.sha256,
                0,
                tmp_path / "other" / "model.gguf",
                ssl.create_default_context(),
                allowed=LOOPBACK,
            )
