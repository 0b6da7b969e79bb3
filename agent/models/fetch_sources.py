"""Connections to the sources of a model file, and what their answers may tell the fetch
(:mod:`agent.models.model_fetch`): a node's file server verified as that node; an http(s) URL
reached at the very address :mod:`common.model_sources` checked after resolution (DNS rebinding
gains nothing), https verified under the URL's host; every socket watched by the fetch's
:class:`~agent.models.fetch_limits.Watchdog` from before its connect. What a URL answers besides the
file is never read: a refusal is its status and standard phrase.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Sequence
from http import HTTPStatus
from urllib.parse import urlsplit

from agent.models.fetch_limits import Watchdog
from common.model_sources import Network, resolve
from common.transfer_ticket import source_tls_name


def open_socket(
    addresses: Sequence[tuple[int, tuple[object, ...]]], timeout: float, watch: Watchdog
) -> socket.socket:
    """A connection to the first of ``addresses`` that answers."""
    error: OSError = OSError("no address to connect to")
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            watch.watch(sock)
            sock.connect(sockaddr)
            if watch.why is not None:  # cut while connecting
                raise OSError(watch.why)
            return sock
        except OSError as e:
            watch.forget()
            sock.close()
            error = e
        except BaseException:
            watch.forget()
            sock.close()
            raise
    raise error


def handshake(
    context: ssl.SSLContext, sock: socket.socket, name: str, watch: Watchdog
) -> ssl.SSLSocket:
    """TLS over ``sock`` (the same descriptor, still watched); closed when it fails."""
    try:
        secure = context.wrap_socket(sock, server_hostname=name, do_handshake_on_connect=False)
    except BaseException:
        watch.forget()
        sock.close()
        raise
    try:
        secure.do_handshake()
    except BaseException:
        watch.forget()
        secure.close()
        raise
    return secure


def connect_url(
    url: str, timeout: float, allowed: Sequence[Network], watch: Watchdog
) -> tuple[http.client.HTTPConnection, str]:
    """A connection to an http(s) URL, at an address checked after resolution (the one
    connected to), and the path to ask for."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host, port, addresses = resolve(url, allowed)
    sock = open_socket([(a.family, a.sockaddr) for a in addresses], timeout, watch)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        context = ssl.create_default_context()
        sock = handshake(context, sock, host, watch)
        # Connected already (never connect() again): the class only gives the Host header.
        connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
    connection.sock = sock
    return connection, path


def connect_node(
    host: str, port: int, node_id: str, context: ssl.SSLContext, timeout: float, watch: Watchdog
) -> http.client.HTTPConnection:
    """A connection to a node's file server (or the controller's store), verified as it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    raw = open_socket([(info[0], info[4]) for info in infos], timeout, watch)
    secure = handshake(context, raw, source_tls_name(node_id), watch)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    connection.sock = secure
    return connection


def describe(error: BaseException) -> str:
    """An error to record: the system's words for an OSError, only the kind of an HTTP
    protocol error (whose message may quote what the source sent)."""
    if isinstance(error, http.client.HTTPException):
        return f"not a valid HTTP answer ({type(error).__name__})"
    return str(error) or type(error).__name__


def refusal_text(response: http.client.HTTPResponse, *, from_url: bool) -> str:
    """What a refusal says: for a node or the controller (the file server of this project,
    behind TLS and a node id), its short reason; for a URL, the status and its standard
    phrase only: an error page there may be a service the node can reach and we cannot."""
    try:
        phrase = HTTPStatus(response.status).phrase
    except ValueError:
        phrase = "an unknown status"
    if from_url:
        return f"{response.status} {phrase}"
    reason = response.read(200).decode("ascii", errors="replace")
    reason = "".join(c if c.isprintable() else " " for c in reason).strip()
    return f"{response.status} {phrase}: {reason}" if reason else f"{response.status} {phrase}"


def announced_size(response: http.client.HTTPResponse, held: int) -> int | None:
    """The whole file's size as the answer announces it (None: it does not say)."""
    length = (response.getheader("Content-Length") or "").strip()
    content_range = response.getheader("Content-Range")
    if response.status == 206 and content_range is not None:
        start, _, total = content_range.removeprefix("bytes ").partition("/")
        if total.strip().isdigit() and start.partition("-")[0].strip() == str(held):
            return int(total)
        return None
    if not length.isdigit():
        return None
    return (held if response.status == 206 else 0) + int(length)
