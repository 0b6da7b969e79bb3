"""This node's single ``ggml-rpc-server`` and what lets only the primaries the controller names
reach it (:class:`RpcWorkerHost`, held by :class:`agent.runtime.llama_handler.LlamaHandler`).

Two gates, one guarantee (no byte from anyone else reaches the worker's RPC code):

* the accept filter (:mod:`agent.runtime.rpc_filter`), loaded into the worker, which listens on the
  node's address itself: nothing sits between the primary and the worker;
* where the filter cannot be used, the copying guard (:mod:`agent.runtime.rpc_guard`) on the node's
  address in front of a worker on loopback (it costs about 5 % of split decode).

Both also check the named primaries against the agent's own ``ALLOWED_PEER_CIDRS``.

Who may connect is the exact set the controller names, never a sum of past ones: every
``StartRpcWorker`` replaces it, and closes the connections still open from addresses it leaves
out (the worker is restarted where the accept filter guards it: its sockets are its own); an
``RpcWorkerPeers`` (a job using the worker ended) replaces it too, but leaves open connections
alone, so a warm llama-server keeps its link until the worker is stopped or taken over. A
revoked node (``NodesRevoked``, ``Welcome.revoked_node_ids``) loses its addresses and its open
connections at once, and is left out of every later set.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from agent.control.control_handler import Send, worker_status
from agent.runtime.endpoints import free_loopback_port, validate_rpc_bind_host
from agent.runtime.out_of_memory import worker_out_of_memory
from agent.runtime.rpc_filter import NamedPeer, PeerFilter
from agent.runtime.rpc_guard import RpcGuard
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime import RuntimeManager
from agent.runtime.runtime_errors import LlamaRuntimeError
from common.contract import OUT_OF_MEMORY
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

#: Where a worker behind the copying guard listens: only its guard faces the network.
LOOPBACK = "127.0.0.1"


class WorkerGate(Protocol):
    """Who may reach the worker on ``host:port``."""

    host: str
    port: int

    @property
    def endpoint(self) -> str: ...

    @property
    def allowed(self) -> frozenset[str]: ...

    def admit_only(self, peers: Iterable[NamedPeer]) -> None: ...

    def revoke(self, node_ids: Iterable[str]) -> frozenset[str]: ...

    async def close(self) -> None: ...


def _listed(addresses: Iterable[str]) -> str:
    """``addresses`` (or node ids) for a log line: sorted, comma-separated; "nobody" for none."""
    return ", ".join(sorted(addresses)) or "nobody"


def named_peers(
    peers: Sequence[pb.RpcPeerAccess], addresses: Iterable[str] = ()
) -> list[NamedPeer]:
    """(node id, address) of ``peers``, and of ``addresses`` they do not name (a controller
    that predates ``peers`` names addresses only)."""
    named = [(peer.node_id, peer.address) for peer in peers]
    known = {address for _, address in named}
    return named + [("", address) for address in addresses if address not in known]


class RpcWorkerHost:
    """The RPC worker and its gate: started, re-gated, cut off and stopped on the controller's
    word. ``attach`` is told the upstream ``send`` of every message (the handler's crash
    reports use it); ``closing`` says whether the agent stops (a new worker is refused)."""

    def __init__(
        self,
        runtime: RuntimeManager,
        data_dir: Path,
        *,
        rpc_port: int,
        rpc_threads: int | None,
        allow_public_rpc: bool,
        allowed_peer_cidrs: tuple[str, ...],
        attach: Callable[[Send], None],
        closing: Callable[[], bool],
    ) -> None:
        self.runtime = runtime
        self.data_dir = data_dir
        self.rpc_port = rpc_port
        self.rpc_threads = rpc_threads
        self.allow_public_rpc = allow_public_rpc
        self.allowed_peer_cidrs = allowed_peer_cidrs
        self._attach = attach
        self._closing = closing
        #: Who may reach the worker (None while none runs).
        self.guard: WorkerGate | None = None
        self._worker_lock = threading.Lock()
        #: Nodes revoked (their addresses are left out of every set the controller names).
        self._revoked_peers: set[str] = set()
        self._workers_starting = 0  # a worker dying while it starts is reported by its status

    @property
    def starting(self) -> bool:
        """Whether a worker is being started (or restarted): its status reports a death."""
        return self._workers_starting > 0

    async def close(self) -> None:
        """Closes the gate (the runtime stops the worker itself)."""
        if self.guard is not None:
            await self.guard.close()
            self.guard = None

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        """Starts (or reuses) the RPC worker on ``msg.host:msg.port``, letting in exactly
        ``msg.peers`` (and closing what is open from anyone else)."""
        self._attach(send)
        port = msg.port or self.rpc_port
        peers = self._unrevoked(named_peers(msg.peers, msg.allowed_peers))
        devices = tuple(msg.devices)
        try:
            if self._closing():
                raise LlamaRuntimeError("agent is stopping")
            bind = validate_rpc_bind_host(msg.host, allow_public=self.allow_public_rpc)
            self._workers_starting += 1
            try:
                guard = await self._ensure_guarded_worker(bind, port, devices)
                guard.admit_only(peers)
                await self._cut_off(guard)
            finally:
                self._workers_starting -= 1
        except (LlamaRuntimeError, ValueError, OSError) as exc:
            log.warning("job %s: RPC worker on %s:%s failed: %s", msg.job_id, msg.host, port, exc)
            failed = pb.RpcWorkerStatus.FAILED
            oom = worker_out_of_memory(exc, devices)
            await send(
                worker_status(
                    msg.job_id,
                    failed,
                    msg.host,
                    port,
                    str(exc),
                    error_code=OUT_OF_MEMORY if oom else "",
                    failed_device=oom.device if oom else "",
                    failed_bytes=oom.bytes if oom else 0,
                )
            )
            return
        log.info(
            "job %s: RPC worker ready on %s for %s",
            msg.job_id,
            guard.endpoint,
            _listed(guard.allowed),
        )
        await send(worker_status(msg.job_id, pb.RpcWorkerStatus.STARTED, guard.host, guard.port))

    async def on_rpc_worker_peers(self, msg: pb.RpcWorkerPeers, send: Send) -> None:
        """A job using the worker ended: exactly ``msg.peers`` may connect from now on (open
        connections stay: a warm llama-server keeps its link)."""
        self._attach(send)
        guard = self.guard
        if guard is None:
            log.debug("RPC worker peers (%s): no worker runs", msg.reason or "-")
            return
        guard.admit_only(self._unrevoked(named_peers(msg.peers)))
        log.info(
            "RPC worker %s now lets in %s (%s)",
            guard.endpoint,
            _listed(guard.allowed),
            msg.reason or "-",
        )

    async def on_nodes_revoked(self, node_ids: Sequence[str]) -> None:
        """Revoked nodes: their addresses leave the worker's set and their open connections
        are closed, at once; later sets that name them leave them out."""
        revoked = set(node_ids) - {""}
        if not revoked:
            return
        self._revoked_peers |= revoked
        guard = self.guard
        if guard is None:
            return
        removed = guard.revoke(revoked)
        if not removed:
            return
        log.warning(
            "RPC worker %s: revoked node(s) %s: refusing %s",
            guard.endpoint,
            _listed(revoked),
            _listed(removed),
        )
        self._workers_starting += 1
        try:
            await self._cut_off(guard, among=removed)
        except (LlamaRuntimeError, ValueError, OSError) as exc:
            log.warning("RPC worker %s: restarting it failed: %s", guard.endpoint, exc)
        finally:
            self._workers_starting -= 1

    def _unrevoked(self, peers: list[NamedPeer]) -> list[NamedPeer]:
        kept = [peer for peer in peers if peer[0] not in self._revoked_peers]
        for node_id, address in peers:
            if node_id in self._revoked_peers:
                log.warning("RPC worker: not letting in %s: node %s is revoked", address, node_id)
        return kept

    async def _cut_off(self, guard: WorkerGate, among: Iterable[str] | None = None) -> None:
        """Closes the connections open to the worker from addresses the gate no longer lets
        in (only from ``among``, when given). The copying guard closes them itself; a worker
        behind the accept filter owns its sockets, so it is restarted (on the same address,
        with the same filter): the primary that keeps the right to connect reconnects."""
        if isinstance(guard, RpcGuard):
            strangers = guard.connected() - guard.allowed
            if among is not None:
                strangers &= set(among)
            if strangers:
                closed = guard.disconnect(strangers)
                log.warning(
                    "RPC worker %s: closed %d connection(s) from %s, no longer let in",
                    guard.endpoint,
                    closed,
                    _listed(strangers),
                )
            return
        worker = self.rpc_worker
        if worker is None or not isinstance(guard, PeerFilter):
            return
        connected = await asyncio.to_thread(worker.connected_peers)
        # Sockets that cannot be read: restart rather than leave someone connected.
        strangers = (
            set(among if among is not None else ("?",))
            if connected is None
            else connected - guard.allowed
        )
        if among is not None:
            strangers &= set(among)
        if not strangers:
            return
        log.warning(
            "RPC worker %s: restarting it to close the connection(s) of %s, no longer let in",
            guard.endpoint,
            _listed(strangers),
        )
        await asyncio.to_thread(self._restart_rpc_worker, guard)

    def _restart_rpc_worker(self, accept_filter: PeerFilter) -> None:
        worker = self.rpc_worker
        devices = worker.devices if worker is not None else ()
        with self._worker_lock:
            self.runtime.stop_rpc_worker(accept_filter.host, accept_filter.port)
        self._ensure_rpc_worker(accept_filter.host, accept_filter.port, accept_filter, devices)

    async def _ensure_guarded_worker(
        self, bind: str, port: int, devices: tuple[str, ...] = ()
    ) -> WorkerGate:
        """The gate on ``bind:port`` with a live worker exposing ``devices`` (a new pair
        replaces an old one on another address; a worker with other devices is restarted)."""
        guard = self.guard
        if guard is not None and (guard.host, guard.port) != (bind, port):
            log.info("replacing RPC worker %s with %s:%s", guard.endpoint, bind, port)
            await self._stop_guarded_worker()
            guard = None
        library = self.runtime.binaries.accept_filter
        if library is not None:
            if not isinstance(guard, PeerFilter):
                peers = self.data_dir / "rpc" / f"allowed-peers-{port}"
                guard = PeerFilter(bind, port, library, peers, self.allowed_peer_cidrs)
            await asyncio.to_thread(self._ensure_rpc_worker, bind, port, guard, devices)
            self.guard = guard
            return guard
        if not isinstance(guard, RpcGuard):
            log.warning(
                "the RPC accept filter was not built with llama.cpp (run `python -m "
                "ops.build_llama`): RPC traffic goes through the copying guard, which costs "
                "about 5 %% of split decode"
            )
        backend = guard.backend[1] if isinstance(guard, RpcGuard) else free_loopback_port()
        await asyncio.to_thread(self._ensure_rpc_worker, LOOPBACK, backend, None, devices)
        if not isinstance(guard, RpcGuard):
            guard = RpcGuard(bind, port, (LOOPBACK, backend), cidrs=self.allowed_peer_cidrs)
            await guard.start()
            self.guard = guard
        return guard

    async def _stop_guarded_worker(self) -> list[tuple[str, int]]:
        guard, self.guard = self.guard, None
        if guard is not None:
            await guard.close()
        stopped = await asyncio.to_thread(self._stop_rpc_workers)
        return [(guard.host, guard.port)] if guard is not None else stopped

    @property
    def rpc_worker(self) -> RpcWorker | None:
        """The running ``ggml-rpc-server``, if any."""
        guard = self.guard
        if guard is None:
            return None
        host, port = guard.backend if isinstance(guard, RpcGuard) else (guard.host, guard.port)
        return self.runtime.rpc_workers.get(f"{host}:{port}")

    async def on_stop_rpc_worker(self, msg: pb.StopRpcWorker, send: Send) -> None:
        self._attach(send)
        stopped = await self._stop_guarded_worker()
        host, port = stopped[0] if stopped else ("", 0)
        log.info("job %s: RPC worker stopped (%s)", msg.job_id, stopped or "none was running")
        await send(worker_status(msg.job_id, pb.RpcWorkerStatus.STOPPED, host, port))

    def _ensure_rpc_worker(
        self,
        host: str,
        port: int,
        accept_filter: PeerFilter | None,
        devices: tuple[str, ...] = (),
    ) -> RpcWorker:
        with self._worker_lock:
            bind = validate_rpc_bind_host(host, allow_public=self.allow_public_rpc)
            for worker in self.runtime.rpc_workers.values():
                if (worker.host, worker.port) != (bind, port):
                    log.info("replacing RPC worker %s with %s:%s", worker.endpoint, bind, port)
                    self.runtime.stop_rpc_worker(worker.host, worker.port)
            return self.runtime.start_rpc_worker(
                bind,
                port,
                threads=self.rpc_threads,
                allow_public=self.allow_public_rpc,
                accept_filter=accept_filter,
                devices=devices,
            )

    def _stop_rpc_workers(self) -> list[tuple[str, int]]:
        with self._worker_lock:
            stopped = []
            for worker in self.runtime.rpc_workers.values():
                self.runtime.stop_rpc_worker(worker.host, worker.port)
                stopped.append((worker.host, worker.port))
            return stopped
