"""Where ``llama-server``, ``ggml-rpc-server`` and the RPC accept filter are: a flag, then
``$DACP_LLAMA_BIN_DIR``, then the build cache of the chosen backend written by
``python -m ops.build_llama`` (recomputed here: agent code never imports ``ops``).

A build in the cache has the backend it was built for. An operator's own build
(``--llama-bin-dir``, ``$DACP_LLAMA_BIN_DIR``) is ``custom`` unless ``--llama-backend`` names
its backend (or the folder is one of the cache's own builds)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.runtime.llama_backend import (
    AUTO,
    BACKENDS,
    CPU,
    CUSTOM,
    ENV_BACKEND,
    BackendChoice,
    backend_dir_name,
    choose_backend,
)
from agent.runtime.rpc_filter import ACCEPT_FILTER_NAME, filter_supported
from agent.runtime.runtime_errors import RuntimeMissingError

LLAMA_DIST_VERSION = "11434.0.0"
#: What ``python -m ops.build_llama`` writes beside the binaries: the dist, version and flags.
BUILD_STAMP_NAME = ".dacp-build.json"
ENV_BIN_DIR = "DACP_LLAMA_BIN_DIR"
ENV_CACHE_DIR = "DACP_CACHE_DIR"

_EXE = ".exe" if sys.platform == "win32" else ""
LLAMA_SERVER_NAMES: tuple[str, ...] = (f"llama-server{_EXE}",)
# `ggml-rpc-server` is the current target name; older llama.cpp builds called it `rpc-server`.
RPC_SERVER_NAMES: tuple[str, ...] = (f"ggml-rpc-server{_EXE}", f"rpc-server{_EXE}")

# --- binaries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeBinaries:
    """The llama.cpp build the agent runs: where it is, its two servers and its filter."""

    bin_dir: Path
    llama_server: Path
    rpc_server: Path
    #: The RPC accept filter (:mod:`agent.runtime.rpc_filter`), when it was built and can be used
    #: here.
    accept_filter: Path | None = None
    #: The build's backend ("cpu", "cuda", "vulkan", "metal"), or "custom" for an operator's
    #: own build (``--llama-bin-dir``, ``$DACP_LLAMA_BIN_DIR``).
    backend: str = CPU


def default_cache_dir() -> Path:
    """``$DACP_CACHE_DIR`` or ``~/.cache/dacp`` (same rule as ``ops/paths.py``)."""
    configured = os.environ.get(ENV_CACHE_DIR)
    if configured:
        return Path(configured).expanduser().resolve()
    return (Path.home() / ".cache" / "dacp").resolve()


def default_bin_dir(backend: str = CPU) -> Path:
    """Where ``python -m ops.build_llama --backend BACKEND`` puts the binaries."""
    folder = backend_dir_name(LLAMA_DIST_VERSION, backend)
    return default_cache_dir() / "llama.cpp" / folder / "bin"


def find_binaries(
    explicit_dir: str | os.PathLike[str] | None = None, backend: str | None = None
) -> RuntimeBinaries:
    """Locate ``llama-server`` and ``ggml-rpc-server``.

    The first configured source wins (no silent fallback past an explicit choice): the
    ``explicit_dir`` argument (the agent's ``--llama-bin-dir`` flag), ``$DACP_LLAMA_BIN_DIR``,
    then the build cache of the backend ``backend`` (``--llama-backend``; None, ``""`` or
    ``auto``: ``$LLAMA_BACKEND``, else this machine's, :func:`choose_backend`).
    Raises :class:`RuntimeMissingError` with a one-line reason, and
    :class:`agent.runtime.llama_backend.BackendError` for a name that is not a backend.
    """
    env_dir = os.environ.get(ENV_BIN_DIR)
    own: Path | None = None
    if explicit_dir is not None and str(explicit_dir) != "":
        own, source = Path(explicit_dir).expanduser(), "--llama-bin-dir"
    elif env_dir:
        own, source = Path(env_dir).expanduser(), f"${ENV_BIN_DIR}"
    if own is not None:
        # An operator's own build: its backend is what it was built with, which only the
        # operator can say (the flag; $LLAMA_BACKEND is for the build cache), unless the
        # folder is one of the build cache's own.
        bin_dir = own
        choice = choose_backend(backend, env={}, detect=lambda: _own_build_backend(own))
        hint = "run `python -m ops.build_llama` (or `make llama`) or set " + ENV_BIN_DIR
    else:
        choice = choose_backend(backend)
        bin_dir = default_bin_dir(choice.backend)
        source = f"the {choice.backend} build cache; backend from {choice.why}"
        hint = (
            f"run `python -m ops.build_llama --backend {choice.backend}` "
            f"(or `{ENV_BACKEND}={choice.backend} make llama`) or set {ENV_BIN_DIR}"
        )
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
        backend=choice.backend,
    )


def _own_build_backend(bin_dir: Path) -> BackendChoice:
    """The backend of the build cache's folder ``bin_dir`` is, or ``custom``."""
    resolved = bin_dir.expanduser().resolve()
    for backend in BACKENDS:
        if default_bin_dir(backend) == resolved:
            return BackendChoice(backend, "the build cache")
    return BackendChoice(CUSTOM, "an operator's own build")


def add_binaries_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's ``--llama-bin-dir`` and ``--llama-backend`` (read by :func:`find_binaries`)."""
    parser.add_argument(
        "--llama-bin-dir",
        type=Path,
        default=None,
        help=(
            "directory with llama-server and ggml-rpc-server, e.g. a llama.cpp release or ROCm "
            f"build of your own (default: ${ENV_BIN_DIR}, else the ops build cache)"
        ),
    )
    parser.add_argument(
        "--llama-backend",
        choices=(AUTO, *BACKENDS),
        default="",
        help=(
            "which backend's build to run from the ops build cache (default: $LLAMA_BACKEND, "
            "else auto: cuda with an NVIDIA GPU and nvcc, vulkan with a Vulkan GPU, its headers "
            "and glslc, metal on macOS, else cpu); with --llama-bin-dir, the backend that build "
            "has (default: custom)"
        ),
    )


def _find_executable(bin_dir: Path, names: Sequence[str]) -> Path | None:
    for name in names:
        candidate = bin_dir / name
        if candidate.is_file() and (sys.platform == "win32" or os.access(candidate, os.X_OK)):
            return candidate.resolve()
    return None
