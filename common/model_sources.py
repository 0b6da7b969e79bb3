"""Where a model's http(s) source may be: anywhere on the operator's network, but not on the
fetching machine itself or its cloud's metadata service, unless the operator allows the
network (the controller's ``MODEL_SOURCE_ALLOWED_CIDRS``, sent with every ``FetchModel``).

Refused by default: loopback (127.0.0.0/8, ::1), link-local (169.254.0.0/16, fe80::/10: the
cloud metadata services live there), the other cloud metadata addresses (fd00:ec2::254,
100.100.100.200, 168.63.129.16) and names (``metadata.google.internal`` and the like, refused
whatever they resolve to), "this network" and unspecified (0.0.0.0/8, ::), multicast and
broadcast. An IPv4 address inside an IPv6 one (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::/96``)
is judged as that IPv4 address.

The controller checks a URL when it is registered (:func:`check_url`); the agent checks it
again after its own DNS resolution and connects to the very address it checked
(:func:`resolve`), so a name that resolves elsewhere later (DNS rebinding) gains nothing.

Imports only the standard library and ``proto``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The operator's setting that allows otherwise refused networks.
SETTING = "MODEL_SOURCE_ALLOWED_CIDRS"

#: Cloud metadata services outside the link-local ranges.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    {
        ipaddress.ip_address("fd00:ec2::254"),  # AWS (IPv6)
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
        ipaddress.ip_address("168.63.129.16"),  # Azure's wire server
    }
)
#: Names of cloud metadata services: refused whatever they resolve to (and wherever they
#: cannot be resolved).
METADATA_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "metadata.azure.internal",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",
        "metadata.platformequinix.com",
    }
)
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_BROADCAST = ipaddress.ip_address("255.255.255.255")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class SourceRefused(ValueError):
    """A model source on an address it may not be on; the message says which and why."""


@dataclass(frozen=True)
class Address:
    """A resolved address a source may be fetched from: connect to ``sockaddr``."""

    family: int
    sockaddr: tuple[Any, ...]


def parse_cidrs(entries: Iterable[str]) -> tuple[Network, ...]:
    """The networks an operator allows (``10.1.0.0/16``, ``127.0.0.1``); ValueError names a
    malformed one."""
    networks = []
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(f"{SETTING}: {text!r} is not a network (CIDR)") from None
    return tuple(networks)


def _as_ipv4(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def refusal(address: IPAddress, allowed: Sequence[Network] = ()) -> str | None:
    """Why a model source may not be on ``address`` (None: it may)."""
    if any(address in network for network in allowed if network.version == address.version):
        return None
    judged = _as_ipv4(address)
    if judged is not address and any(
        judged in network for network in allowed if network.version == judged.version
    ):
        return None
    if judged in METADATA_ADDRESSES or address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if judged.is_loopback:
        return "a loopback address"
    if judged.is_link_local:
        return "a link-local address (where cloud metadata services are)"
    if judged.is_unspecified or judged in _THIS_NETWORK:
        return "an unspecified address"
    if judged.is_multicast or judged == _BROADCAST:
        return "a multicast or broadcast address"
    return None


def _host_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url} has no valid port") from None
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise ValueError(f"{url} names no host")
    return host, port or (443 if parts.scheme == "https" else 80)


def _refuse(url: str, host: str, why: str) -> SourceRefused:
    return SourceRefused(
        f"model source {url} is refused: {host} is {why}; an operator who means it allows the "
        f"network with {SETTING} on the controller"
    )


def resolve(url: str, allowed: Sequence[Network] = ()) -> tuple[str, int, list[Address]]:
    """The URL's host and port, and the addresses to connect to (each one checked). Raises
    :class:`SourceRefused` when the host is a metadata name or any address it resolves to is
    refused (one bad address is enough: which one a client picks is not ours to know),
    ValueError for a URL without a host or with an invalid port, and OSError when it does not
    resolve."""
    host, port = _host_of(url)
    if host in METADATA_NAMES:
        raise _refuse(url, host, "a cloud metadata service")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = []
    for family, _, _, _, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        why = refusal(address, allowed)
        if why is not None:
            shown = host if host == str(address) else f"{host} ({address})"
            raise _refuse(url, shown, why)
        addresses.append(Address(family, sockaddr))
    if not addresses:
        raise OSError(f"{host} has no address")
    return host, port, addresses


def check_url(url: str, allowed: Sequence[Network] = ()) -> None:
    """Raises :class:`SourceRefused` for a URL a node would refuse to fetch from. A name that
    does not resolve here passes: nodes resolve it on their own network, and check it then."""
    try:
        resolve(url, allowed)
    except ValueError as e:
        if isinstance(e, SourceRefused):
            raise
        raise SourceRefused(f"model source {url} is not a valid URL: {e}") from None
    except OSError:
        return
