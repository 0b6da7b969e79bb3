"""``ggml-rpc-server``, bound to one private address (with its accept filter, when given:
:mod:`agent.runtime.rpc_filter`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from agent.runtime.endpoints import port_is_free, validate_rpc_bind_host
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.managed_child import ExitCallback, ManagedChild, describe_exit
from agent.runtime.rpc_filter import PeerFilter, canonical
from agent.runtime.runtime_errors import PortInUseError
from agent.runtime.server_spec import DEVICE_NAME
from common.contract import DEFAULT_RPC_PORT

log = logging.getLogger(__name__)


# --- RPC worker --------------------------------------------------------------------------


class RpcWorker(ManagedChild):
    """``ggml-rpc-server`` bound to one private IPv4 address."""

    role = "ggml-rpc-server"

    def __init__(
        self,
        binaries: RuntimeBinaries,
        host: str,
        port: int = DEFAULT_RPC_PORT,
        *,
        log_dir: Path,
        threads: int | None = None,
        use_cache: bool = False,
        allow_public: bool = False,
        on_exit: ExitCallback | None = None,
        env: Mapping[str, str] | None = None,
        accept_filter: PeerFilter | None = None,
        devices: Sequence[str] = (),
    ) -> None:
        if accept_filter is not None:
            env = {**(env or {}), **accept_filter.env()}
        super().__init__(log_dir=log_dir, on_exit=on_exit, env=env)
        self.accept_filter = accept_filter
        if not 0 < port < 65536:
            raise ValueError(f"invalid RPC port {port}")
        if threads is not None and threads < 1:
            raise ValueError(f"invalid thread count {threads}")
        self.binaries = binaries
        self.host = validate_rpc_bind_host(host, allow_public=allow_public)
        self.port = port
        self.threads = threads
        self.use_cache = use_cache
        #: What it exposes (``--device``, in this order: the primary numbers them so); empty:
        #: llama.cpp's default (every device of the build).
        self.devices = tuple(devices)
        for device in self.devices:
            if not DEVICE_NAME.fullmatch(device):
                raise ValueError(f"invalid device name {device!r}")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(self.binaries.rpc_server), "--host", self.host, "--port", str(self.port)]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.use_cache:
            argv.append("--cache")
        if self.devices:
            argv += ["--device", ",".join(self.devices)]
        return argv

    def start(self, timeout: float = 30.0) -> None:
        """Start and wait until the worker listens (and its accept filter is loaded).

        Readiness is read from the process's own sockets, not probed with a connection: a
        probe would be one more client for a worker that serves one at a time, and one its
        filter refuses."""
        if self.alive:
            return
        if not port_is_free(self.host, self.port):
            raise PortInUseError(f"cannot start ggml-rpc-server: {self.endpoint} is already in use")
        self._spawn(self.argv(), f"rpc-worker-{self.host}-{self.port}.log")
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
            if self._listening():
                self._check_filter()
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise self._start_failure(f"did not accept connections within {timeout:.0f}s")
            time.sleep(0.1)

    def _listening(self) -> bool:
        pid = self.pid
        if pid is None:
            return False
        try:
            sockets = psutil.Process(pid).net_connections(kind="tcp4")
        except psutil.Error:
            return False
        return any(
            s.status == psutil.CONN_LISTEN and tuple(s.laddr) == (self.host, self.port)
            for s in sockets
        )

    def connected_peers(self) -> set[str] | None:
        """The addresses of the clients the worker has a connection open with (as its accept
        filter compares them); None when its sockets cannot be read."""
        pid = self.pid
        if pid is None or not self.alive:
            return set()
        try:
            sockets = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            return None
        return {
            canonical(s.raddr.ip)
            for s in sockets
            if s.raddr and s.status == psutil.CONN_ESTABLISHED and s.laddr.port == self.port
        }

    def _check_filter(self) -> None:
        """A worker whose filter did not load would serve anyone: stopped, never used."""
        pid = self.pid
        if self.accept_filter is None or pid is None:
            return
        try:
            self.accept_filter.verify(pid)
        except RuntimeError as exc:
            self.stop()
            raise self._start_failure(f"refused: {exc}") from exc
