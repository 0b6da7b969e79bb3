"""``ggml-rpc-server``, bound to one private address."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from agent.agent_config import DEFAULT_RPC_PORT
from agent.endpoints import port_is_free, probe_tcp, validate_rpc_bind_host
from agent.llama_binaries import RuntimeBinaries
from agent.managed_child import ExitCallback, ManagedChild, describe_exit
from agent.runtime_errors import PortInUseError

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
    ) -> None:
        super().__init__(log_dir=log_dir, on_exit=on_exit, env=env)
        if not 0 < port < 65536:
            raise ValueError(f"invalid RPC port {port}")
        if threads is not None and threads < 1:
            raise ValueError(f"invalid thread count {threads}")
        self.binaries = binaries
        self.host = validate_rpc_bind_host(host, allow_public=allow_public)
        self.port = port
        self.threads = threads
        self.use_cache = use_cache

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(self.binaries.rpc_server), "--host", self.host, "--port", str(self.port)]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.use_cache:
            argv.append("--cache")
        return argv

    def start(self, timeout: float = 30.0) -> None:
        """Start and wait until the worker accepts TCP connections."""
        if self.alive:
            return
        if not port_is_free(self.host, self.port):
            raise PortInUseError(f"cannot start ggml-rpc-server: {self.endpoint} is already in use")
        self._spawn(self.argv(), f"rpc-worker-{self.host}-{self.port}.log")
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
            if probe_tcp(self.host, self.port, timeout=0.5):
                # a probe answered by someone else would race our bind; make sure we are alive
                time.sleep(0.05)
                if self.alive:
                    return
                continue
            if time.monotonic() >= deadline:
                self.stop()
                raise self._start_failure(f"did not accept connections within {timeout:.0f}s")
            time.sleep(0.1)
