"""Addresses and ports for llama.cpp children: safe RPC bind hosts (never ``0.0.0.0``: the RPC
protocol is unauthenticated), ``host:port`` parsing, TCP probes and free loopback ports."""

from __future__ import annotations

import ipaddress
import socket
import sys

from agent.runtime.runtime_errors import UnsafeBindError
from wire import control_pb2 as pb

# --- addresses and ports -----------------------------------------------------------------


def validate_rpc_bind_host(host: str, *, allow_public: bool = False) -> str:
    """Return the IPv4 address an RPC worker may bind to, or raise :class:`UnsafeBindError`.

    ``ggml-rpc-server`` executes whatever graph a client sends and has no authentication, so it
    must listen on one private interface: wildcard (``0.0.0.0``), multicast, broadcast and (unless
    ``allow_public``) globally routable addresses are refused. It only speaks IPv4.
    """
    text = host.strip()
    if text.lower() == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise UnsafeBindError(f"RPC worker host must be an IPv4 address, got {host!r}") from None
    if address.version != 4:
        raise UnsafeBindError(f"ggml-rpc-server binds IPv4 only, got {host!r}")
    if address.is_unspecified:
        raise UnsafeBindError(
            f"refusing to bind ggml-rpc-server to {host}: the RPC protocol is unauthenticated; "
            "bind the node's private LAN address instead"
        )
    if address.is_multicast or address.is_reserved or text == "255.255.255.255":
        raise UnsafeBindError(f"refusing to bind ggml-rpc-server to {host}: not a host address")
    if address.is_global and not allow_public:
        raise UnsafeBindError(
            f"refusing to bind ggml-rpc-server to public address {host}; use a private address"
        )
    return str(address)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv4 or hostname) and validate the port."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"RPC endpoint must look like host:port, got {endpoint!r}")
    return host, int(port_text)


def probe_tcp(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_is_free(host: str, port: int) -> bool:
    """True if ``host:port`` can be bound right now (mirrors the servers' SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if sys.platform != "win32":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def peer_endpoint(peer: pb.RpcPeer) -> str:
    """``host:port`` of an RPC worker a plan names (``--rpc``)."""
    return f"{peer.host}:{peer.port}"
