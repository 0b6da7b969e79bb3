"""The RPC-worker half of :class:`agent.llama_handler.LlamaHandler`: this node's single
``ggml-rpc-server`` and what lets only the primaries the controller names reach it.

Two gates, one guarantee (no byte from anyone else reaches the worker's RPC code):

* the accept filter (:mod:`agent.rpc_filter`), loaded into the worker, which listens on the
  node's address itself: nothing sits between the primary and the worker;
* where the filter cannot be used, the copying guard (:mod:`agent.rpc_guard`) on the node's
  address in front of a worker on loopback (it costs about 5 % of split decode).

Both also check the named primaries against the agent's own ``ALLOWED_PEER_CIDRS``.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from agent.control_handler import Send, worker_status
from agent.endpoints import free_loopback_port, validate_rpc_bind_host
from agent.rpc_filter import PeerFilter
from agent.rpc_guard import RpcGuard
from agent.rpc_worker import RpcWorker
from agent.runtime import RuntimeManager
from agent.runtime_errors import LlamaRuntimeError
from proto import control_pb2 as pb

log = logging.getLogger(__name__)

#: Where a worker behind the copying guard listens: only its guard faces the network.
LOOPBACK = "127.0.0.1"


class WorkerGate(Protocol):
    """Who may reach the worker on ``host:port``."""

    host: str
    port: int
    allowed: set[str]

    @property
    def endpoint(self) -> str: ...

    def allow(self, addresses: Iterable[str]) -> None: ...

    async def close(self) -> None: ...


class RpcWorkerHost:
    runtime: RuntimeManager
    data_dir: Path
    rpc_port: int
    rpc_threads: int | None
    allow_public_rpc: bool
    allowed_peer_cidrs: tuple[str, ...]
    _closed: bool
    _workers_starting: int
    _guard: WorkerGate | None
    _worker_lock: threading.Lock
    _attach: Callable[[Send], None]

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        """Starts (or reuses) the RPC worker on ``msg.host:msg.port``, letting in
        ``msg.allowed_peers`` only."""
        self._attach(send)
        port = msg.port or self.rpc_port
        try:
            if self._closed:
                raise LlamaRuntimeError("agent is stopping")
            bind = validate_rpc_bind_host(msg.host, allow_public=self.allow_public_rpc)
            self._workers_starting += 1
            try:
                guard = await self._ensure_guarded_worker(bind, port)
            finally:
                self._workers_starting -= 1
        except (LlamaRuntimeError, ValueError, OSError) as exc:
            log.warning("job %s: RPC worker on %s:%s failed: %s", msg.job_id, msg.host, port, exc)
            failed = pb.RpcWorkerStatus.FAILED
            await send(worker_status(msg.job_id, failed, msg.host, port, str(exc)))
            return
        guard.allow(tuple(msg.allowed_peers))
        log.info(
            "job %s: RPC worker ready on %s for %s",
            msg.job_id,
            guard.endpoint,
            ", ".join(sorted(guard.allowed)) or "nobody",
        )
        await send(worker_status(msg.job_id, pb.RpcWorkerStatus.STARTED, guard.host, guard.port))

    async def _ensure_guarded_worker(self, bind: str, port: int) -> WorkerGate:
        """The gate on ``bind:port`` with a live worker (a new pair replaces an old one on
        another address)."""
        guard = self._guard
        if guard is not None and (guard.host, guard.port) != (bind, port):
            log.info("replacing RPC worker %s with %s:%s", guard.endpoint, bind, port)
            await self._stop_guarded_worker()
            guard = None
        library = self.runtime.binaries.accept_filter
        if library is not None:
            if not isinstance(guard, PeerFilter):
                peers = self.data_dir / "rpc" / f"allowed-peers-{port}"
                guard = PeerFilter(bind, port, library, peers, self.allowed_peer_cidrs)
            await asyncio.to_thread(self._ensure_rpc_worker, bind, port, guard)
            self._guard = guard
            return guard
        if not isinstance(guard, RpcGuard):
            log.warning(
                "the RPC accept filter was not built with llama.cpp (run `python -m "
                "ops.build_llama`): RPC traffic goes through the copying guard, which costs "
                "about 5 %% of split decode"
            )
        backend = guard.backend[1] if isinstance(guard, RpcGuard) else free_loopback_port()
        await asyncio.to_thread(self._ensure_rpc_worker, LOOPBACK, backend, None)
        if not isinstance(guard, RpcGuard):
            guard = RpcGuard(bind, port, (LOOPBACK, backend), cidrs=self.allowed_peer_cidrs)
            await guard.start()
            self._guard = guard
        return guard

    async def _stop_guarded_worker(self) -> list[tuple[str, int]]:
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.close()
        stopped = await asyncio.to_thread(self._stop_rpc_workers)
        return [(guard.host, guard.port)] if guard is not None else stopped

    @property
    def rpc_worker(self) -> RpcWorker | None:
        """The running ``ggml-rpc-server``, if any."""
        guard = self._guard
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
        self, host: str, port: int, accept_filter: PeerFilter | None
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
            )

    def _stop_rpc_workers(self) -> list[tuple[str, int]]:
        with self._worker_lock:
            stopped = []
            for worker in self.runtime.rpc_workers.values():
                self.runtime.stop_rpc_worker(worker.host, worker.port)
                stopped.append((worker.host, worker.port))
            return stopped
