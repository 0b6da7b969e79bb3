"""uvicorn's warnings about what a connection sent ("Invalid HTTP request received.") name
the peer (address and port) and, when it is recognisable, what it sent instead of HTTP/1.1:
a TLS handshake or gRPC's HTTP/2 preface, as an agent pointed at the HTTP port sends.

uvicorn logs them on ``uvicorn.error`` from inside the protocol's ``data_received``, without
the peer. :class:`PeerNamingProtocol` (the controller's ``uvicorn.Config(http=...)``) notes the
peer while it handles data, and :class:`PeerNamingFilter` (installed on ``uvicorn.error`` by
:func:`install`) adds it to the warnings logged meanwhile.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The logger uvicorn's protocols warn on.
UVICORN_ERROR_LOGGER = "uvicorn.error"
#: What a client that does not speak HTTP/1.x sends first, and what it likely is.
_NOT_HTTP1 = (
    (
        b"\x16\x03",
        "a TLS handshake on the plain HTTP port: a node agent given it instead of GRPC_PORT?",
    ),
    (
        b"PRI * HTTP/2.0",
        "HTTP/2 without TLS: a gRPC client (a node agent with --insecure) given "
        "the HTTP port instead of GRPC_PORT?",
    ),
)

#: The peer whose data the protocol is handling now, and that data: described only when a
#: warning is logged, so a well-formed request pays one context-variable set and reset.
_HANDLING: ContextVar[tuple[tuple[str, int] | None, bytes] | None] = ContextVar(
    "http_peer", default=None
)


def describe_peer(client: tuple[str, int] | None, data: bytes) -> str:
    """``from 192.0.2.7:51234``, with what ``data`` looks like when it is not HTTP/1.x."""
    source = f"from {client[0]}:{client[1]}" if client else "from an unknown peer"
    for prefix, what in _NOT_HTTP1:
        if data.startswith(prefix):
            return f"{source}: {what}"
    return source


class PeerNamingProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol; what it logs while handling a peer's data names the peer."""

    def data_received(self, data: bytes) -> None:
        token = _HANDLING.set((self.client, data))
        try:
            super().data_received(data)
        finally:
            _HANDLING.reset(token)


class PeerNamingFilter(logging.Filter):
    """Adds the peer being handled to uvicorn's warnings (``… (from 192.0.2.7:51234)``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        handling = _HANDLING.get()
        if handling is not None and record.levelno >= logging.WARNING:
            record.msg = f"{record.getMessage()} ({describe_peer(*handling)})"
            record.args = None
        return True


_FILTER = PeerNamingFilter()


def install() -> None:
    """Puts the filter on uvicorn's logger (once, however often it is called)."""
    logging.getLogger(UVICORN_ERROR_LOGGER).addFilter(_FILTER)
