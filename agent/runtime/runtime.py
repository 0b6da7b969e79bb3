"""The runtime manager: the llama.cpp children of one node agent.

:class:`RuntimeManager` keeps one warm ``llama-server`` per spec and the local RPC workers. The
pieces it composes each have their own module:

* ``agent/runtime/llama_binaries.py`` finds ``llama-server`` and ``ggml-rpc-server``;
* ``agent/runtime/rpc_worker.py`` runs ``ggml-rpc-server`` bound to one private address;
* ``agent/runtime/llama_server.py`` runs ``llama-server`` on a free loopback port, optionally
  spreading layers over RPC workers, and streams OpenAI-style chat completions;
* ``agent/runtime/managed_child.py`` is what both have in common: logs, stop, crash detection; the
  children die with the agent (``agent/runtime/child_process.py``);
* ``agent/runtime/endpoints.py`` and ``agent/runtime/runtime_errors.py``: addresses, ports and
  errors.

Agent code imports only the standard library, ``httpx`` and ``proto`` (never the controller or
``ops``). Blocking calls (starting processes and waiting for readiness) are synchronous; from
asyncio use :meth:`RuntimeManager.ensure_server_async` or ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.runtime.endpoints import validate_rpc_bind_host
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_server import LlamaServer
from agent.runtime.managed_child import ExitCallback
from agent.runtime.rpc_filter import PeerFilter
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime_errors import LlamaRuntimeError
from agent.runtime.server_spec import ServerSpec
from common.contract import DEFAULT_RPC_PORT

log = logging.getLogger(__name__)


# --- manager -----------------------------------------------------------------------------


class RuntimeManager:
    """Owns the agent's llama.cpp children: one warm ``llama-server`` and local RPC workers."""

    def __init__(
        self,
        binaries: RuntimeBinaries,
        log_dir: str | os.PathLike[str],
        *,
        on_exit: ExitCallback | None = None,
        server_host: str = "127.0.0.1",
        start_timeout: float = 180.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.binaries = binaries
        self.log_dir = Path(log_dir)
        self._on_exit = on_exit
        self._server_host = server_host
        self._start_timeout = start_timeout
        self._env = dict(env) if env else None
        self._server: LlamaServer | None = None
        self._workers: dict[tuple[str, int], RpcWorker] = {}
        # Separate locks: starting a worker must not wait for a model to load.
        self._server_lock = threading.Lock()
        self._workers_lock = threading.Lock()
        self._closed = False

    @property
    def server(self) -> LlamaServer | None:
        return self._server

    @property
    def rpc_workers(self) -> dict[str, RpcWorker]:
        with self._workers_lock:
            return {worker.endpoint: worker for worker in self._workers.values()}

    def ensure_server(self, spec: ServerSpec) -> LlamaServer:
        """Return the running server for ``spec``, or (re)start one. Blocks until healthy."""
        with self._server_lock:
            if self._closed:
                raise LlamaRuntimeError("runtime manager is closed")
            current = self._server
            if current is not None and current.spec == spec and current.alive:
                return current
            if current is not None:
                reason = "spec changed" if current.spec != spec else "it exited"
                log.info("restarting llama-server (%s)", reason)
                current.stop()
                self._server = None
            server = LlamaServer(
                self.binaries,
                spec,
                log_dir=self.log_dir,
                host=self._server_host,
                on_exit=self._on_exit,
                env=self._env,
            )
            server.start(timeout=self._start_timeout)
            self._server = server
            return server

    def running_server(self, spec: ServerSpec) -> LlamaServer | None:
        """The server already running for ``spec``, if any (never starts or stops one)."""
        with self._server_lock:
            current = self._server
            if self._closed or current is None or current.spec != spec or not current.alive:
                return None
            return current

    async def ensure_server_async(self, spec: ServerSpec) -> LlamaServer:
        return await asyncio.to_thread(self.ensure_server, spec)

    def stop_server(self) -> None:
        with self._server_lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def start_rpc_worker(
        self,
        host: str,
        port: int = DEFAULT_RPC_PORT,
        *,
        threads: int | None = None,
        allow_public: bool = False,
        accept_filter: PeerFilter | None = None,
        timeout: float = 30.0,
        devices: Sequence[str] = (),
    ) -> RpcWorker:
        """Start (or return the already running) RPC worker on ``host:port`` (letting in only
        the peers of ``accept_filter``, when given) exposing ``devices``; one running with other
        devices is restarted."""
        bind_host = validate_rpc_bind_host(host, allow_public=allow_public)
        with self._workers_lock:
            if self._closed:
                raise LlamaRuntimeError("runtime manager is closed")
            key = (bind_host, port)
            existing = self._workers.get(key)
            if existing is not None and existing.alive:
                if existing.devices == tuple(devices):
                    return existing
                log.info(
                    "restarting RPC worker %s: devices %s instead of %s",
                    existing.endpoint,
                    ",".join(devices) or "(default)",
                    ",".join(existing.devices) or "(default)",
                )
                existing.stop()
            worker = RpcWorker(
                self.binaries,
                bind_host,
                port,
                log_dir=self.log_dir,
                threads=threads,
                allow_public=allow_public,
                on_exit=self._on_exit,
                env=self._env,
                accept_filter=accept_filter,
                devices=devices,
            )
            worker.start(timeout=timeout)
            self._workers[key] = worker
            return worker

    def stop_rpc_worker(self, host: str, port: int = DEFAULT_RPC_PORT) -> bool:
        """Stop the worker on ``host:port``; False if there was none."""
        with self._workers_lock:
            worker = self._workers.pop(
                (validate_rpc_bind_host(host, allow_public=True), port), None
            )
        if worker is None:
            return False
        worker.stop()
        return True

    def close(self) -> None:
        """Stop the server first (it holds connections to the workers), then the workers."""
        self._closed = True
        with self._server_lock:
            server, self._server = self._server, None
            if server is not None:
                server.stop()
        with self._workers_lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.stop()

    def __enter__(self) -> RuntimeManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
