"""RPC peers of a plan: whether a warm llama-server is still linked to them, and a TCP probe
before setup.

RPC workers serve one client at a time and queue at most two pending connections
(``listen(fd, 1)``), so a TCP probe of a worker that a warm llama-server is connected to would
sit in its accept queue, and the third such probe would time out. The warm server's own
connections are therefore inspected instead: endpoints it holds ``ESTABLISHED`` links to are
not probed, and a warm server whose link to a peer broke (worker restarted or died) is
restarted rather than reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Sequence

import psutil

from agent.runtime.endpoints import peer_endpoint
from agent.runtime.job_messages import RPC_PEER_UNREACHABLE, SetupFailure
from agent.runtime.llama_server import LlamaServer
from agent.runtime.server_spec import ServerSpec
from wire import control_pb2 as pb

log = logging.getLogger(__name__)


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


def established_endpoints(pid: int, endpoints: Sequence[str]) -> set[str] | None:
    """Those of ``endpoints`` (``host:port``) process ``pid`` has an ESTABLISHED TCP link to;
    None when its connections cannot be inspected."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    linked: set[str] = set()
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        for conn in connections:
            raddr = conn.raddr
            if (
                raddr
                and conn.status == psutil.CONN_ESTABLISHED
                and raddr.port == int(port)
                and _same_host(raddr.ip, host)
            ):
                linked.add(endpoint)
                break
    return linked


async def probe_peer(host: str, port: int, timeout: float) -> str | None:
    """None if ``host:port`` accepts a TCP connection within ``timeout``, else the reason."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    return None


async def probe_peers(peers: Sequence[pb.RpcPeer], timeout: float) -> None:
    """Raises :class:`SetupFailure` (``RPC_PEER_UNREACHABLE``, blaming the peer's node) for the
    first of ``peers`` that does not accept a TCP connection within ``timeout``."""
    if not peers:
        return
    reasons = await asyncio.gather(*(probe_peer(peer.host, peer.port, timeout) for peer in peers))
    for peer, reason in zip(peers, reasons, strict=True):
        if reason is not None:
            raise SetupFailure(
                RPC_PEER_UNREACHABLE,
                f"RPC worker of node {peer.node_id or '?'} at {peer_endpoint(peer)} "
                f"is unreachable: {reason}",
                failed_node_id=peer.node_id,
            )


def warm_links(server: LlamaServer | None, spec: ServerSpec) -> tuple[set[str], bool]:
    """(peers the warm ``server`` for ``spec`` is linked to, whether it must be restarted)."""
    if (
        server is None
        or not server.alive
        or server.spec != spec
        or server.pid is None
        or not spec.rpc_endpoints
    ):
        return set(), False
    linked = established_endpoints(server.pid, spec.rpc_endpoints)
    if linked is None:  # cannot look: trust the warm server rather than fill accept queues
        return set(spec.rpc_endpoints), False
    broken = [endpoint for endpoint in spec.rpc_endpoints if endpoint not in linked]
    if broken:
        log.info("warm llama-server lost its link to %s; it will be restarted", broken)
    return linked, bool(broken)
