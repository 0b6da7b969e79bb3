"""Builds the ControlHandler the agent hands downlink messages to.

With ``config.llama_runtime`` (the CLI's default; ``--no-runtime`` turns it off) this is the
llama.cpp :class:`agent.runtime.llama_handler.LlamaHandler`, and missing binaries are a fatal
configuration error (:class:`RuntimeUnavailable`, printed as one line, exit code 2). Without
it the agent runs :class:`agent.control.control_client.NullHandler`, which refuses every plan.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

from agent.agent_config import AgentConfig, ConfigError
from agent.control.control_handler import ControlHandler, NullHandler
from agent.runtime.llama_backend import BackendError
from agent.runtime.llama_binaries import RuntimeBinaries, find_binaries
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.runtime_errors import RuntimeMissingError


class RuntimeUnavailable(ConfigError):
    """The llama.cpp binaries are not where the configuration says."""


def resolve_binaries(config: AgentConfig) -> RuntimeBinaries:
    """The llama.cpp build this agent runs: ``config.llama_bin_dir`` (``--llama-bin-dir``),
    else ``$DACP_LLAMA_BIN_DIR``, else the ``ops`` build cache of the backend
    ``config.llama_backend`` (``--llama-backend``), ``$LLAMA_BACKEND`` or this machine chose.
    The one place the agent turns its configuration into binaries (the handler and device
    discovery both use it)."""
    try:
        return find_binaries(config.llama_bin_dir, config.llama_backend)
    except BackendError as exc:
        raise RuntimeUnavailable(f"llama.cpp runtime unavailable: {exc}") from None
    except RuntimeMissingError as exc:
        raise RuntimeUnavailable(
            f"llama.cpp runtime unavailable: {exc}, or pass --llama-bin-dir DIR "
            "(--no-runtime runs the agent without llama.cpp)"
        ) from None


def build_handler(config: AgentConfig) -> ControlHandler:
    """The handler for this agent's configuration (binaries: :func:`resolve_binaries`)."""
    if not config.llama_runtime:
        return NullHandler()
    binaries = resolve_binaries(config)
    return LlamaHandler(
        binaries,
        models_dir=config.resolved_models_dir,
        data_dir=config.data_dir,
        log_dir=config.resolved_runtime_log_dir,
        slots=config.slots,
        rpc_port=config.rpc_port,
        rpc_threads=config.threads,
        server_threads=config.threads,
        server_poll=config.poll,
        memory_limit_bytes=config.memory_limit_bytes,
        stream_interval=config.stream_interval,
        allowed_peer_cidrs=config.allowed_peer_cidrs,
    )
