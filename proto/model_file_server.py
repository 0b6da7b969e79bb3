"""Serves model files: HTTPS ``GET /models/<sha256>``, byte ranges (a cut transfer resumes),
each request carrying a transfer ticket the controller signed for that model and the fetching
node (:mod:`proto.transfer_ticket`), on a connection whose client certificate is that node's.
Everyone else gets 401/403 and no byte of the file; so does a node revoked since its ticket
was signed (:meth:`ModelFileServer.revoke`).

Nodes serve the files they hold with it (``agent.model_transfers``), and the controller its
own model store (``interfaces.model_store_server``): one implementation for both ends.

Runs in threads of its own (one per connection), outside any event loop: a transfer moves
hundreds of megabytes and must be bound by the link, not by a loop.

Imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from proto.transfer_ticket import MODELS_PATH, TicketError, peer_node_id, verify_ticket

log = logging.getLogger(__name__)

#: Bytes read from the file and written to the connection at a time.
CHUNK = 1 << 20
_PATH = re.compile(r"^" + re.escape(MODELS_PATH) + r"([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-$")

#: The verified file holding a model, by sha256 (None: not held here).
Resolve = Callable[[str], Path | None]


class _Handler(BaseHTTPRequestHandler):
    server: ModelFileServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # The TLS handshake runs here, in the connection's thread, not in the accept loop.
        self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: object) -> None:
        log.debug("model server: " + format, *args)

    def _refuse(self, status: HTTPStatus, why: str) -> None:
        body = why.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        log.warning("model server: refused %s from %s: %s", self.path, self.client_address[0], why)

    def do_GET(self) -> None:
        match = _PATH.match(self.path)
        if match is None:
            self._refuse(HTTPStatus.NOT_FOUND, "no such path")
            return
        sha256 = match.group(1)
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            self._refuse(HTTPStatus.UNAUTHORIZED, "a transfer ticket is required")
            return
        try:
            ticket = verify_ticket(auth.removeprefix("Bearer "), self.server.ca_pem, time.time())
        except TicketError as e:
            self._refuse(HTTPStatus.FORBIDDEN, str(e))
            return
        client = peer_node_id(self.connection.getpeercert())  # type: ignore[attr-defined]
        if ticket.sha256 != sha256 or client is None or ticket.node_id != client:
            self._refuse(HTTPStatus.FORBIDDEN, "the ticket is for another model or node")
            return
        if client in self.server.revoked:
            self._refuse(HTTPStatus.FORBIDDEN, f"node {client} has been revoked")
            return
        path = self.server.resolve(sha256)
        if path is None:
            self._refuse(HTTPStatus.NOT_FOUND, "this node does not hold that model")
            return
        self._send(path, client)

    def _send(self, path: Path, client: str) -> None:
        size = path.stat().st_size
        start = 0
        wanted = self.headers.get("Range")
        if wanted:
            match = _RANGE.match(wanted)
            if match is None or int(match.group(1)) > size:
                self._refuse(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, f"bad range {wanted}")
                return
            start = int(match.group(1))
        self.send_response(HTTPStatus.PARTIAL_CONTENT if wanted else HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        started = time.monotonic()
        sent = 0
        try:
            with path.open("rb", buffering=0) as source:
                source.seek(start)
                buffer = bytearray(CHUNK)
                view = memoryview(buffer)
                while n := source.readinto(buffer):
                    self.wfile.write(view[:n])
                    sent += n
                    self.server.bytes_sent += n
        except OSError as e:  # the fetcher went away: it resumes later
            log.info(
                "model server: %s to node %s cut after %d bytes: %s", path.name, client, sent, e
            )
            return
        seconds = max(time.monotonic() - started, 1e-6)
        log.info(
            "model server: sent %s (%d bytes from %d) to node %s at %.0f MB/s",
            path.name,
            sent,
            start,
            client,
            sent / seconds / 1e6,
        )


class ModelFileServer(ThreadingHTTPServer):
    """HTTPS on ``host:port`` with this node's certificate; clients show theirs."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        log.info("model server: connection from %s failed", client_address)

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext, ca_pem: str, resolve: Resolve
    ) -> None:
        super().__init__((host, port), _Handler)
        self.socket = context.wrap_socket(
            self.socket, server_side=True, do_handshake_on_connect=False
        )
        self.ca_pem = ca_pem.encode()
        self.resolve = resolve
        #: Bytes sent since start.
        self.bytes_sent = 0
        #: Nodes refused whatever their ticket and certificate say (revoked since).
        self.revoked: frozenset[str] = frozenset()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def revoke(self, node_ids: Iterable[str]) -> None:
        """Refuses these nodes from now on (a download under way is not cut)."""
        self.revoked = self.revoked | frozenset(node_ids)

    def start(self) -> ModelFileServer:
        self._thread = threading.Thread(
            target=self.serve_forever, name="model-file-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
