"""The address a node agent advertises unless told (``--advertise-address``): the one it reaches
the controller from (what the controller sees, and checks at enrollment), else a private
address of an interface that is up, physical-looking ones first.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from agent.agent_config import ConfigError, parse_controller_url

# Interfaces that are usually not the LAN peers should use (tried after the others).
_VIRTUAL_INTERFACE_PREFIXES = (
    "docker",
    "br-",
    "veth",
    "virbr",
    "cni",
    "flannel",
    "lxc",
    "vmnet",
    "vboxnet",
    "vethernet",
    "tun",
    "tap",
    "wg",
    "tailscale",
    "zt",
)


def private_ipv4_addresses() -> list[str]:
    """Private (RFC 1918) IPv4 addresses of the interfaces that are up; physical-looking
    interfaces first, bridges/VPNs after."""
    try:
        addresses = psutil.net_if_addrs()
        stats = psutil.net_if_stats()
    except (OSError, RuntimeError):
        return []
    preferred: list[str] = []
    others: list[str] = []
    for name, entries in addresses.items():
        stat = stats.get(name)
        if stat is not None and not stat.isup:
            continue
        for entry in entries:
            if entry.family != socket.AF_INET:
                continue
            try:
                ip = ipaddress.IPv4Address(entry.address)
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or not ip.is_private:
                continue
            bucket = others if name.lower().startswith(_VIRTUAL_INTERFACE_PREFIXES) else preferred
            bucket.append(str(ip))
    return preferred + others


def default_advertise_address(controller_url: str | None = None) -> str:
    """The address this machine reaches the controller from (what the controller sees, and
    checks at enrollment), when it is private or loopback; else the first non-loopback private
    IPv4 address, else 127.0.0.1 (single-machine setups)."""
    route = _route_address(controller_url) if controller_url else None
    if route is not None:
        return route
    candidates = private_ipv4_addresses()
    return candidates[0] if candidates else "127.0.0.1"


def _route_address(controller_url: str) -> str | None:
    """The local address the kernel picks to reach the controller (no packet is sent: a UDP
    socket is only connected)."""
    try:
        try:
            target = parse_controller_url(controller_url)
        except ConfigError:  # grpc://, which is for --insecure: only the address matters here
            target = parse_controller_url(controller_url, insecure=True)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target.host, target.port))
            local = ipaddress.IPv4Address(probe.getsockname()[0])
    except (ConfigError, OSError, ValueError):
        return None
    return str(local) if local.is_private or local.is_loopback else None
