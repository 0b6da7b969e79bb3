"""Where ``llama-server``, ``ggml-rpc-server`` and the RPC accept filter are: a flag, then
``$DACP_LLAMA_BIN_DIR``, then the build cache written by ``python -m ops.build_llama``
(recomputed here: agent code never imports ``ops``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.rpc_filter import ACCEPT_FILTER_NAME, filter_supported
from agent.runtime_errors import RuntimeMissingError

LLAMA_DIST_VERSION = "11434.0.0"
ENV_BIN_DIR = "DACP_LLAMA_BIN_DIR"
ENV_CACHE_DIR = "DACP_CACHE_DIR"

_EXE = ".exe" if sys.platform == "win32" else ""
LLAMA_SERVER_NAMES: tuple[str, ...] = (f"llama-server{_EXE}",)
# `ggml-rpc-server` is the current target name; older llama.cpp builds called it `rpc-server`.
RPC_SERVER_NAMES: tuple[str, ...] = (f"ggml-rpc-server{_EXE}", f"rpc-server{_EXE}")

# --- binaries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeBinaries:
    bin_dir: Path
    llama_server: Path
    rpc_server: Path
    #: The RPC accept filter (:mod:`agent.rpc_filter`), when it was built and can be used here.
    accept_filter: Path | None = None
    #: The build's backend ("cpu", "cuda", "vulkan", "metal"), or "custom" for an operator's
    #: own build (``--llama-bin-dir``, ``$DACP_LLAMA_BIN_DIR``).
    backend: str = "cpu"


def default_cache_dir() -> Path:
    """``$DACP_CACHE_DIR`` or ``~/.cache/dacp`` (same rule as ``ops/paths.py``)."""
    configured = os.environ.get(ENV_CACHE_DIR)
    if configured:
        return Path(configured).expanduser().resolve()
    return (Path.home() / ".cache" / "dacp").resolve()


def default_bin_dir() -> Path:
    """Where ``python -m ops.build_llama`` puts the binaries."""
    return default_cache_dir() / "llama.cpp" / LLAMA_DIST_VERSION / "bin"


def find_binaries(explicit_dir: str | os.PathLike[str] | None = None) -> RuntimeBinaries:
    """Locate ``llama-server`` and ``ggml-rpc-server``.

    The first configured source wins (no silent fallback past an explicit choice): the
    ``explicit_dir`` argument (the agent's ``--llama-bin-dir`` flag), ``$DACP_LLAMA_BIN_DIR``,
    then the build cache. Raises :class:`RuntimeMissingError` with a one-line reason.
    """
    env_dir = os.environ.get(ENV_BIN_DIR)
    if explicit_dir is not None and str(explicit_dir) != "":
        bin_dir, source = Path(explicit_dir).expanduser(), "--llama-bin-dir"
    elif env_dir:
        bin_dir, source = Path(env_dir).expanduser(), f"${ENV_BIN_DIR}"
    else:
        bin_dir, source = default_bin_dir(), "the build cache"
    hint = "run `python -m ops.build_llama` (or `make llama`) or set " + ENV_BIN_DIR
    if not bin_dir.is_dir():
        raise RuntimeMissingError(f"llama.cpp bin dir {bin_dir} (from {source}) missing; {hint}")
    llama_server = _find_executable(bin_dir, LLAMA_SERVER_NAMES)
    if llama_server is None:
        raise RuntimeMissingError(f"llama-server not found in {bin_dir} (from {source}); {hint}")
    rpc_server = _find_executable(bin_dir, RPC_SERVER_NAMES)
    if rpc_server is None:
        raise RuntimeMissingError(f"ggml-rpc-server not found in {bin_dir} (from {source}); {hint}")
    accept_filter = bin_dir / ACCEPT_FILTER_NAME
    return RuntimeBinaries(
        bin_dir=bin_dir.resolve(),
        llama_server=llama_server,
        rpc_server=rpc_server,
        accept_filter=accept_filter.resolve()
        if filter_supported() and accept_filter.is_file()
        else None,
    )


def _find_executable(bin_dir: Path, names: Sequence[str]) -> Path | None:
    for name in names:
        candidate = bin_dir / name
        if candidate.is_file() and (sys.platform == "win32" or os.access(candidate, os.X_OK)):
            return candidate.resolve()
    return None
