"""Who may reach this node's RPC worker, enforced inside ``ggml-rpc-server`` itself.

``ggml-rpc-server`` has no authentication (and a history of memory-safety bugs), so it must
serve only the primary whose llama-server uses it. The agent loads a small accept filter into
it (``agent/runtime/native/rpc_accept_filter.c``, ``LD_PRELOAD``, built by ``python -m
ops.build_llama`` next to the llama.cpp binaries): the worker's ``accept()`` closes every
connection whose peer address is not a line of the allowed-peers file this module writes. The
worker listens on the node's LAN address; accepted connections are its own sockets, so the RPC
traffic (a round trip per token in split decode) crosses nothing extra.

The file starts empty (nobody gets in) and lists only addresses inside the agent's
``ALLOWED_PEER_CIDRS``. Every ``StartRpcWorker`` (and ``RpcWorkerPeers``) names the exact set,
which replaces the file; a revoked node's addresses leave it at once (:class:`PeerSet`).
:meth:`PeerFilter.verify` checks, from ``/proc``, that the filter is really mapped into the
worker before the agent reports it ready (a library the dynamic loader could not load would
otherwise leave the worker open). Where the filter cannot be used (not Linux, no C compiler at
build time), the agent falls back to the copying guard (:mod:`agent.runtime.rpc_guard`).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: The variable naming the allowed-peers file (read by the filter at every connection).
ALLOWED_PEERS_ENV = "DACP_RPC_ALLOWED_PEERS"
#: The filter's shared library, next to ``ggml-rpc-server``.
ACCEPT_FILTER_NAME = "libdacp_rpc_accept_filter.so"
#: Its source, compiled by ``ops.build_llama``.
ACCEPT_FILTER_SOURCE = Path(__file__).resolve().parent / "native" / "rpc_accept_filter.c"


def filter_supported() -> bool:
    """``LD_PRELOAD`` and ``/proc/<pid>/maps``: Linux."""
    return sys.platform.startswith("linux")


def peer_allowed(address: str, cidrs: Sequence[str]) -> bool:
    """Whether ``address`` (an IP literal; IPv4-mapped IPv6 judged as IPv4) is inside ``cidrs``."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for cidr in cidrs:
        network = ipaddress.ip_network(cidr, strict=False)
        if ip.version == network.version and ip in network:
            return True
    return False


def canonical(address: str) -> str:
    """The text the filter compares with: what ``inet_ntop`` prints for the peer."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def admissible(addresses: Iterable[str], cidrs: Sequence[str], endpoint: str) -> set[str]:
    """The named primaries a worker's gate lets in: those inside ``cidrs``, as the gate
    compares them (:func:`canonical`); the others are logged."""
    admitted = set()
    for address in addresses:
        if peer_allowed(address, cidrs):
            admitted.add(canonical(address))
        else:
            log.warning(
                "RPC worker %s: not letting in %s, outside ALLOWED_PEER_CIDRS (%s)",
                endpoint,
                address,
                ", ".join(cidrs),
            )
    return admitted


#: A peer as the controller names it: (node id, address); the node id may be "" (unknown).
NamedPeer = tuple[str, str]


@dataclass(frozen=True)
class PeerSet:
    """The addresses a worker's gate lets in, each with the nodes it was named for (so that a
    node's revocation takes its addresses out)."""

    owners: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset(self.owners)

    @classmethod
    def of(cls, peers: Iterable[NamedPeer], cidrs: Sequence[str], endpoint: str) -> PeerSet:
        """Exactly ``peers`` that lie inside ``cidrs`` (the others are logged), as the gate
        compares them (:func:`canonical`)."""
        owners: dict[str, set[str]] = {}
        for node_id, address in peers:
            for admitted in admissible((address,), cidrs, endpoint):
                owners.setdefault(admitted, set()).add(node_id)
        return cls({address: frozenset(nodes) for address, nodes in owners.items()})

    def without_nodes(self, node_ids: Iterable[str]) -> PeerSet:
        """This set less every address named for one of ``node_ids`` (another node named at
        the same address loses it too: the gate tells peers apart by address only)."""
        gone = set(node_ids) - {""}
        return PeerSet({a: n for a, n in self.owners.items() if not n & gone})


class PeerGate:
    """What every gate in front of a worker on ``host:port`` holds: the agent's CIDRs and the
    peers it lets in (the accept filter, :class:`PeerFilter`, and the copying guard,
    :class:`agent.runtime.rpc_guard.RpcGuard`)."""

    def __init__(self, host: str, port: int, cidrs: Sequence[str]) -> None:
        self.host, self.port = host, port
        self.cidrs = tuple(cidrs)
        #: Who may connect (the primaries using the worker), by address.
        self.peers = PeerSet()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def allowed(self) -> frozenset[str]:
        """The addresses that may connect."""
        return self.peers.addresses


class PeerFilter(PeerGate):
    """The worker on ``host:port`` and the file of addresses its accept filter lets in."""

    def __init__(
        self, host: str, port: int, library: Path, peers_file: Path, cidrs: Sequence[str]
    ) -> None:
        super().__init__(host, port, cidrs)
        self.library = library
        self.peers_file = peers_file
        self._write()

    def env(self) -> dict[str, str]:
        """What the worker is started with."""
        return {"LD_PRELOAD": str(self.library), ALLOWED_PEERS_ENV: str(self.peers_file)}

    def admit_only(self, peers: Iterable[NamedPeer]) -> None:
        """From now on exactly ``peers`` may connect (an address outside the agent's CIDRs is
        refused, logged); whoever was let in before and is not named is refused."""
        self._set(PeerSet.of(peers, self.cidrs, self.endpoint))

    def revoke(self, node_ids: Iterable[str]) -> frozenset[str]:
        """Refuses the addresses named for ``node_ids`` at once; returns them."""
        before = self.allowed
        self._set(self.peers.without_nodes(node_ids))
        return before - self.allowed

    def _set(self, peers: PeerSet) -> None:
        changed = peers.addresses != self.allowed
        self.peers = peers
        if changed:
            self._write()

    def verify(self, pid: int) -> None:
        """Raises ``RuntimeError`` unless the filter is mapped into process ``pid``."""
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise RuntimeError(f"cannot read the worker's memory map: {exc}") from exc
        if str(self.library) not in maps:
            raise RuntimeError(f"the RPC accept filter {self.library} is not loaded in the worker")

    async def close(self) -> None:
        """Empties the file (nobody gets in) and removes it; the worker is stopped apart."""
        self.peers = PeerSet()
        self._write()
        self.peers_file.unlink(missing_ok=True)

    def _write(self) -> None:
        """Replaces the file in one step: the filter reads either the old list or the new."""
        self.peers_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.peers_file.parent, prefix=".peers-")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.writelines(f"{address}\n" for address in sorted(self.allowed))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.peers_file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
