"""An http model source for tests, on loopback: it serves a file (byte ranges too), or
misbehaves as told: an error page carrying a secret, a body trickled a byte at a time, one
sent steadily but slowly, a size other than the file's. Over TLS when given a server context
(a node's file server, as a peer that lies would run it). It counts the requests it gets."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: What an error page of a service on the node's loopback might hold.
SECRET = "s3cr3t-token-0f-a-l00pback-service"

SERVE = "serve"
ERROR = "error"
TRICKLE = "trickle"
SLOW = "slow"
WRONG_SIZE = "wrong-size"
#: SLOW sends this many bytes every SLOW_EVERY seconds (160 KiB/s).
SLOW_PIECE = 16 << 10
SLOW_EVERY = 0.1


@dataclass
class HttpSource:
    data: bytes
    mode: str = SERVE
    #: Seconds between two trickled bytes.
    trickle_every: float = 0.2
    requests: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    port: int = 0
    url: str = ""


@contextmanager
def http_source(
    data: bytes, mode: str = SERVE, context: ssl.SSLContext | None = None
) -> Iterator[HttpSource]:
    source = HttpSource(data, mode)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            source.requests += 1
            if source.mode == ERROR:
                body = f"<h1>500</h1><p>internal error; token={SECRET}</p>".encode()
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            start = 0
            if wanted := self.headers.get("Range"):
                start = int(wanted.removeprefix("bytes=").removesuffix("-"))
            rest = source.data[start:]
            length = len(rest) + (1 << 20 if source.mode == WRONG_SIZE else 0)
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(length))
            if start:
                total = len(source.data)
                self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
            self.end_headers()
            if source.mode == TRICKLE:
                for byte in rest:
                    if source.stop.wait(source.trickle_every):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                return
            if source.mode == SLOW:
                for at in range(0, len(rest), SLOW_PIECE):
                    if source.stop.wait(SLOW_EVERY):
                        return
                    self.wfile.write(rest[at : at + SLOW_PIECE])
                return
            self.wfile.write(rest)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    source.port = int(server.server_address[1])
    source.url = f"http://127.0.0.1:{source.port}/models/model.gguf"
    try:
        yield source
    finally:
        source.stop.set()
        server.shutdown()
        server.server_close()
