"""Serves model files: HTTPS ``GET /models/<sha256>``, byte ranges (a cut transfer resumes),
each request carrying a transfer ticket the controller signed for that model and the fetching
node (:mod:`common.transfer_ticket`), on a connection whose client certificate is that node's.
Everyone else gets 401/403 and no byte of the file; so does a node revoked since its ticket
was signed (:meth:`ModelFileServer.revoke`).

It also answers link probes (:mod:`common.link_probe`): ``GET /probe/<n>`` streams ``n`` zero
bytes (at most ``MAX_PROBE_BYTES``, else 400) to a node whose ticket names ``PROBE_SUBJECT``
instead of a model, authorized as a file is; a probe ticket fetches no file, and a file's
ticket no probe.

Nodes serve the files they hold with it (``agent.models.model_transfers``), and the controller its
own model store (``interfaces.model_store_server``): one implementation for both ends.

What a connection may cost (:class:`ServerLimits`) is bounded before anyone has shown a
certificate:

* one thread accepts connections and runs their TLS handshakes and reads their request heads,
  all non-blocking: an idle or stalled connection holds a file descriptor, never a thread;
* a connection has ``handshake_timeout`` seconds from its accept to finish the handshake and
  send its whole request head (at most :data:`MAX_REQUEST_HEAD` bytes), or it is closed;
* at most ``max_connections`` are open at once, at most ``per_address`` of them from one
  address; one more is closed as soon as it is accepted;
* only a complete request, from a client whose certificate the CA issued, reaches one of at
  most ``workers`` threads, which sends the file or the probe's bytes (one request per
  connection); a fetcher that takes more than ``send_timeout`` seconds over a 1 MiB piece of
  it is cut.

A transfer moves hundreds of megabytes and must be bound by the link, not by a loop: the
workers write with blocking sockets, outside any event loop.

Imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import re
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from common.link_probe import MAX_PROBE_BYTES, PROBE_PATH, PROBE_SUBJECT
from common.transfer_ticket import MODELS_PATH, TicketError, peer_node_id, verify_ticket

log = logging.getLogger(__name__)

#: Bytes read from the file and written to the connection at a time.
CHUNK = 1 << 20
#: A piece of a chunk written with the time left of the chunk's deadline.
WRITE_PIECE = 256 << 10
_PATH = re.compile(r"^" + re.escape(MODELS_PATH) + r"([0-9a-f]{64})$")
_PROBE = re.compile(r"^" + re.escape(PROBE_PATH) + r"(\d{1,12})$")
_RANGE = re.compile(r"^bytes=(\d+)-$")
#: The largest request head (request line and headers) a server reads.
MAX_REQUEST_HEAD = 16 << 10
#: Defaults of :class:`ServerLimits` (the controller's ``MODEL_STORE_*`` settings).
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_WORKERS = 16
DEFAULT_CONNECTIONS_PER_ADDRESS = 8
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_SEND_TIMEOUT = 60.0

#: The verified file holding a model, by sha256 (None: not held here).
Resolve = Callable[[str], Path | None]


@dataclass(frozen=True)
class ServerLimits:
    """What the connections to one file server may hold (see the module's docstring)."""

    #: Seconds from accept to a complete request head (the TLS handshake included).
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: Threads sending files (a request waits for a free one).
    workers: int = DEFAULT_WORKERS
    #: Connections open at once from one address, in every phase.
    per_address: int = DEFAULT_CONNECTIONS_PER_ADDRESS
    #: Connections open at once, from every address.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Seconds a fetcher has to take each 1 MiB of the file.
    send_timeout: float = DEFAULT_SEND_TIMEOUT

    def __post_init__(self) -> None:
        if self.handshake_timeout <= 0 or self.send_timeout <= 0:
            raise ValueError("a file server's timeouts must be positive")
        if min(self.workers, self.per_address, self.max_connections) < 1:
            raise ValueError("a file server needs at least one worker and one connection")


@dataclass
class _Pending:
    """A connection before its request: handshaking, then reading the head."""

    sock: ssl.SSLSocket
    address: str
    deadline: float
    handshaken: bool = False
    head: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class _Request:
    """A connection whose whole request head has arrived, for a worker."""

    sock: ssl.SSLSocket
    address: str
    head: bytes


class _Writer(io.BufferedIOBase):
    """The handler's ``wfile``: every write goes straight to the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class _Handler(BaseHTTPRequestHandler):
    server: ModelFileServer  # type: ignore[assignment]
    request: _Request  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # The handshake is done and the head read (by the server's accept loop).
        self.connection = self.request.sock
        self.rfile = io.BytesIO(self.request.head)
        self.wfile = _Writer(self.request.sock)

    def handle(self) -> None:
        """One request per connection: an idle keep-alive would hold a worker."""
        self.close_connection = True
        self.handle_one_request()

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, message)
        self.send_header("Connection", "close")

    def log_message(self, format: str, *args: object) -> None:
        log.debug("model server: " + format, *args)

    def _refuse(self, status: HTTPStatus, why: str) -> None:
        body = why.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        log.warning(
            "model server: refused %s from %s: %s", self.path[:200], self.client_address[0], why
        )

    def _write_within(self, data: memoryview, seconds: float) -> None:
        """Sends ``data`` (a piece of the file or probe) within ``seconds``, or raises
        TimeoutError: a fetcher that reads a byte now and then cannot hold a worker."""
        deadline = time.monotonic() + seconds
        for at in range(0, len(data), WRITE_PIECE):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(data)} bytes not taken within {seconds:g} s")
            self.connection.settimeout(left)
            self.connection.sendall(data[at : at + WRITE_PIECE])

    def do_GET(self) -> None:
        if self.path.startswith(PROBE_PATH):
            self._probe()
            return
        match = _PATH.match(self.path)
        if match is None:
            self._refuse(HTTPStatus.NOT_FOUND, "no such path")
            return
        sha256 = match.group(1)
        client = self._authorized(sha256)
        if client is None:
            return
        path = self.server.resolve(sha256)
        if path is None:
            self._refuse(HTTPStatus.NOT_FOUND, "this node does not hold that model")
            return
        self._send(path, client)

    def _authorized(self, subject: str) -> str | None:
        """The node this request comes from, when its ticket names ``subject`` (a model's
        sha256, or ``PROBE_SUBJECT``) and that node, and the node is not revoked; otherwise
        None, the refusal sent."""
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            self._refuse(HTTPStatus.UNAUTHORIZED, "a transfer ticket is required")
            return None
        try:
            ticket = verify_ticket(auth.removeprefix("Bearer "), self.server.ca_pem, time.time())
        except TicketError as e:
            self._refuse(HTTPStatus.FORBIDDEN, str(e))
            return None
        client = peer_node_id(self.connection.getpeercert())  # type: ignore[attr-defined]
        if ticket.sha256 != subject or client is None or ticket.node_id != client:
            self._refuse(HTTPStatus.FORBIDDEN, "the ticket is for another model or node")
            return None
        if client in self.server.revoked:
            self._refuse(HTTPStatus.FORBIDDEN, f"node {client} has been revoked")
            return None
        return client

    def _probe(self) -> None:
        """``GET /probe/<n>``: ``n`` zero bytes, for a peer measuring its link to this node."""
        client = self._authorized(PROBE_SUBJECT)
        if client is None:
            return
        match = _PROBE.match(self.path)
        size = int(match.group(1)) if match is not None else 0
        if not 1 <= size <= MAX_PROBE_BYTES:
            why = f"a probe asks for 1 to {MAX_PROBE_BYTES} bytes: /probe/<bytes>"
            self._refuse(HTTPStatus.BAD_REQUEST, why)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        zeros = memoryview(bytes(min(CHUNK, size)))
        sent = 0
        try:
            while sent < size:
                n = min(len(zeros), size - sent)
                self._write_within(zeros[:n], self.server.limits.send_timeout)
                sent += n
        except OSError as e:  # the prober went away: its measure fails, nothing else
            log.info("model server: probe to node %s cut after %d bytes: %s", client, sent, e)
            return
        log.debug("model server: sent a %d-byte probe to node %s", size, client)

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
                    self._write_within(view[:n], self.server.limits.send_timeout)
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


class ModelFileServer:
    """HTTPS on ``host:port`` with this node's certificate; clients show theirs."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext,
        ca_pem: str,
        resolve: Resolve,
        limits: ServerLimits | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.context = context
        self.ca_pem = ca_pem.encode()
        self.resolve = resolve
        self.limits = limits or ServerLimits()
        #: Bytes of model files sent since start (probes not counted).
        self.bytes_sent = 0
        #: Connections closed at accept: beyond ``max_connections`` or an address's share.
        self.refused = 0
        #: Connections closed for want of a complete request head within the handshake timeout.
        self.timed_out = 0
        #: Nodes refused whatever their ticket and certificate say (revoked since).
        self.revoked: frozenset[str] = frozenset()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._pending: dict[ssl.SSLSocket, _Pending] = {}
        self._lock = threading.Lock()
        self._open = 0
        self._by_address: Counter[str] = Counter()
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def revoke(self, node_ids: Iterable[str]) -> None:
        """Refuses these nodes from now on (a download under way is not cut)."""
        self.revoked = self.revoked | frozenset(node_ids)

    def connections(self) -> int:
        """Connections open now, in every phase."""
        with self._lock:
            return self._open

    def start(self) -> ModelFileServer:
        self._thread = threading.Thread(target=self._serve, name="model-file-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Closes the port and every connection not being served; transfers under way end
        on their own."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(10)
        else:
            self._close_all()
        while True:  # requests no worker took yet
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                break
            if request is not None:
                self._finish(request.sock, request.address)
        with self._lock:
            workers = len(self._workers)
        for _ in range(workers):
            self._requests.put(None)
        self._wake_w.close()

    # The accept loop: handshakes and request heads, never blocking.

    def _serve(self) -> None:
        selector = self._selector
        selector.register(self.socket, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stopping:
                deadlines = [p.deadline for p in self._pending.values()]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in selector.select(wait):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif isinstance(key.data, _Pending):
                        self._advance(key.data)
                self._expire(time.monotonic())
        except Exception:  # never silently: the port would stay open and serve nothing
            log.exception("model server: the accept loop failed")
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for pending in list(self._pending.values()):
            self._drop(pending)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.close()
        self.socket.close()
        self._wake_r.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst, then the others get their turn
            try:
                conn, client = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the next round tries again
                log.warning("model server: cannot accept: %s", e)
                return
            address = str(client[0])
            with self._lock:
                allowed = (
                    self._open < self.limits.max_connections
                    and self._by_address[address] < self.limits.per_address
                )
                if allowed:
                    self._open += 1
                    self._by_address[address] += 1
            if not allowed:
                self.refused += 1
                log.debug("model server: refused a connection from %s (too many)", address)
                conn.close()
                continue
            try:
                conn.setblocking(False)
                sock = self.context.wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False
                )
            except (OSError, ValueError) as e:
                log.debug("model server: connection from %s failed: %s", address, e)
                conn.close()
                self._release(address)
                continue
            deadline = time.monotonic() + self.limits.handshake_timeout
            pending = _Pending(sock, address, deadline)
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)
            self._advance(pending)

    def _advance(self, pending: _Pending) -> None:
        """Takes the handshake, then the request head, as far as what has arrived allows."""
        sock = pending.sock
        try:
            if not pending.handshaken:
                sock.do_handshake()
                pending.handshaken = True
            while True:
                data = sock.recv(MAX_REQUEST_HEAD + 1 - len(pending.head))
                if not data:
                    self._drop(pending)  # gone before its request
                    return
                pending.head += data
                if b"\r\n\r\n" in pending.head:
                    self._dispatch(pending)
                    return
                if len(pending.head) > MAX_REQUEST_HEAD:
                    log.info("model server: %s sent a request head too long", pending.address)
                    self._drop(pending)
                    return
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, pending)
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, pending)
        except (OSError, ValueError) as e:  # a failed handshake: no certificate, say
            log.info("model server: connection from %s failed: %s", pending.address, e)
            self._drop(pending)

    def _expire(self, now: float) -> None:
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self.timed_out += 1
            log.info(
                "model server: closed a connection from %s: no request within %.0f s",
                pending.address,
                self.limits.handshake_timeout,
            )
            self._drop(pending)

    def _unwatch(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending) -> None:
        self._unwatch(pending)
        self._finish(pending.sock, pending.address)

    def _finish(self, sock: socket.socket, address: str) -> None:
        with contextlib.suppress(OSError):
            sock.close()
        self._release(address)

    def _release(self, address: str) -> None:
        with self._lock:
            self._open -= 1
            self._by_address[address] -= 1
            if self._by_address[address] <= 0:
                del self._by_address[address]

    def _dispatch(self, pending: _Pending) -> None:
        """Hands a complete request to a worker (started when none is free, up to the most)."""
        self._unwatch(pending)
        sock = pending.sock
        try:
            sock.setblocking(True)
            sock.settimeout(self.limits.send_timeout)
        except OSError:
            self._finish(sock, pending.address)
            return
        self._requests.put(_Request(sock, pending.address, bytes(pending.head)))
        with self._lock:
            if self._idle or len(self._workers) >= self.limits.workers:
                return
            worker = threading.Thread(
                target=self._work, name=f"model-file-worker-{len(self._workers)}", daemon=True
            )
            self._workers.append(worker)
            self._idle += 1  # counted as free until it takes its first request
        worker.start()

    def _work(self) -> None:
        first = True  # counted as free already, by _dispatch
        while True:
            if not first:
                with self._lock:
                    self._idle += 1
            first = False
            request = self._requests.get()
            with self._lock:
                self._idle -= 1
            if request is None:
                return
            try:
                _Handler(request, (request.address, 0), self)  # type: ignore[arg-type]
            except Exception as e:  # one request's failure ends that request only
                log.info("model server: request from %s failed: %s", request.address, e)
            finally:
                self._finish(request.sock, request.address)
