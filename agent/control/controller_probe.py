"""What answers at the controller address when the control channel cannot be reached there: an
HTTP/1.x server (the controller's HTTP API, given instead of its gRPC port) is told apart from
a network fault, so the agent names the real cause instead of retrying forever.

The probe speaks HTTP/1.1 over TLS and then over plain TCP, and reports the status line of an
answer. A gRPC server never answers HTTP/1.1: over TLS it picks ``h2`` and over plain TCP it
answers with an HTTP/2 frame. Nothing secret is sent (no token, no credential).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import socket
import ssl

from agent.agent_config import AgentError
from common.contract import DEFAULT_GRPC_PORT

#: How long each probe connection may take (seconds): it runs after a failed attempt.
PROBE_TIMEOUT = 2.0
_HTTP_STATUS = b"HTTP/1."
_MAX_STATUS_LINE = 200


class ControllerIsHttp(AgentError):
    """The controller address answers HTTP/1.x: the HTTP API, not the control channel."""

    def __init__(self, url: str, host: str, status_line: str) -> None:
        super().__init__(
            f"{url} answers HTTP ({status_line!r}): this is the HTTP API; the control channel "
            f"is on GRPC_PORT ({DEFAULT_GRPC_PORT} by default): pass --controller-url "
            f"{host}:{DEFAULT_GRPC_PORT} (or the controller's GRPC_PORT)"
        )


def _request(host: str) -> bytes:
    return f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("ascii")


def _status_line(sock: socket.socket) -> str | None:
    """The first line of the answer, when it is an HTTP/1.x status line."""
    data = b""
    while b"\r\n" not in data and len(data) < _MAX_STATUS_LINE:
        chunk = sock.recv(_MAX_STATUS_LINE)
        if not chunk:
            break
        data += chunk
    if not data.startswith(_HTTP_STATUS):
        return None
    return data.split(b"\r\n", 1)[0].decode("latin-1").strip()


def _over_tls(host: str, port: int, timeout: float) -> str | None:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # nothing secret is sent; only the answer's form matters
    context.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=host or None) as tls,
    ):
        if tls.selected_alpn_protocol() == "h2":  # what a gRPC server picks
            return None
        tls.sendall(_request(host))
        return _status_line(tls)


def _over_tcp(host: str, port: int, timeout: float) -> str | None:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(_request(host))
        return _status_line(sock)


def http_status_line(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """The status line an HTTP/1.x server at ``host:port`` answers with (over TLS, else plain
    TCP); None when nothing there speaks HTTP/1.x (a gRPC server, a closed port, no route)."""
    for probe in (_over_tls, _over_tcp):
        try:
            status = probe(host, port, timeout)
        except (OSError, ValueError):  # ssl.SSLError is an OSError
            continue
        if status is not None:
            return status
    return None
