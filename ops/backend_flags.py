"""The CMake flags that give a llama.cpp build its backend (``agent/runtime/llama_backend.py``
chooses it).

- ``cpu``: none (the build's common flags, ``ops.build_llama.CMAKE_FLAGS``, are a CPU build);
- ``cuda``: ``-DGGML_CUDA=ON``, the CUDA architectures and the ``nvcc`` found
  (:func:`agent.runtime.llama_backend.find_nvcc`). The architectures come from
  ``$CUDA_ARCHITECTURES`` (``90``, ``"86;89"``, ``8.9``), else from the local GPUs' compute
  capability (NVML, else ``nvidia-smi``); a machine with neither is a one-line error saying to set
  it;
- ``vulkan``: ``-DGGML_VULKAN=ON``;
- ``metal``: ``-DGGML_METAL=ON`` with the shader library embedded in the binaries.

Before a CUDA build the toolkit is checked for what llama.cpp links (cuBLAS and the driver
library or its stub), so a partial toolkit is a one-line error naming the part, not a CMake
error about a missing ``CUDA::cublas`` target.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.runtime.llama_backend import (
    BACKENDS,
    CPU,
    CUDA,
    ENV_CUDA_ARCHITECTURES,
    METAL,
    VULKAN,
    BackendError,
    find_nvcc,
)
from ops import vulkan_headers
from ops.paths import FetchError

VULKAN_FLAGS: tuple[str, ...] = ("-DGGML_VULKAN=ON",)
METAL_FLAGS: tuple[str, ...] = ("-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON")
_ARCH_HINT = (
    f"set {ENV_CUDA_ARCHITECTURES} to the GPUs' compute capability without the dot "
    f'(e.g. {ENV_CUDA_ARCHITECTURES}=90 for an H100, "86;89" for two kinds)'
)
#: One entry of CMAKE_CUDA_ARCHITECTURES: ``90``, ``90a``, ``86-real``, ``89-virtual``.
_ARCH = re.compile(r"^\d{2,3}[af]?(-real|-virtual)?$")
#: A compute capability as NVML and nvidia-smi give it: ``9.0``.
_CAPABILITY = re.compile(r"^(\d+)\.(\d+)$")
_CMAKE_KEYWORDS = ("native", "all", "all-major")
#: Where a driver's unversioned ``libcuda.so`` may be (the toolkit ships a stub too).
_SYSTEM_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/lib/wsl/lib",
)


#: Why a machine without nvcc cannot build the ``cuda`` backend.
NO_NVCC = (
    "the cuda backend needs nvcc (the CUDA toolkit): none on PATH, in $CUDACXX, "
    "$CUDA_HOME or /usr/local/cuda"
)


def backend_cmake_flags(backend: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The flags ``backend`` adds to the common ones. Raises :class:`FetchError` (one line)
    when this machine cannot configure it (no ``nvcc``, a partial toolkit, no architectures)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown llama.cpp backend {backend!r}; one of {', '.join(BACKENDS)}")
    if backend == CPU:
        return ()
    if backend == VULKAN:
        if shutil.which("glslc") is None:
            raise FetchError(
                "the vulkan backend needs glslc (the shader compiler; Debian: apt install glslc "
                "libvulkan-dev) and the Vulkan loader"
            )
        return (*VULKAN_FLAGS, *vulkan_headers.include_flags())
    if backend == METAL:
        return METAL_FLAGS
    assert backend == CUDA
    env = os.environ if env is None else env
    nvcc = find_nvcc(env)
    if nvcc is None:
        raise FetchError(NO_NVCC)
    root = toolkit_root(nvcc)
    problem = cuda_toolkit_problem(root)
    if problem is not None:
        raise FetchError(problem)
    real = root / "bin" / nvcc.name  # past a wrapper script such as /usr/local/bin/nvcc
    return cuda_flags(real if os.access(real, os.X_OK) else nvcc, root, cuda_architectures(env))


def cuda_flags(nvcc: Path, root: Path, architectures: str) -> tuple[str, ...]:
    """The ``cuda`` backend's flags for this compiler, its toolkit (CMake's own search for the
    libraries would otherwise take whichever toolkit it finds first) and these architectures."""
    return (
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={architectures}",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        f"-DCUDAToolkit_ROOT={root}",
    )


def cuda_architectures(
    env: Mapping[str, str] | None = None,
    *,
    nvml_module: Any | None = None,
    run: Callable[[list[str]], str] | None = None,
) -> str:
    """``$CUDA_ARCHITECTURES``, else the local GPUs' compute capabilities (``9.0`` → ``90``),
    deduplicated and joined by ``;``. Raises :class:`FetchError` when neither gives one."""
    env = os.environ if env is None else env
    configured = (env.get(ENV_CUDA_ARCHITECTURES) or "").strip()
    if configured:
        return normalize_architectures(configured)
    found = nvml_capabilities(nvml_module) or smi_capabilities(run)
    if not found:
        raise FetchError(f"no NVIDIA GPU here to read its compute capability from; {_ARCH_HINT}")
    return normalize_architectures(";".join(found))


def normalize_architectures(text: str) -> str:
    """``"9.0, 8.6;90"`` → ``"90;86"``: CMake's spelling, each once, in the order given."""
    out: list[str] = []
    for token in (t for t in re.split(r"[;,\s]+", text.strip()) if t):
        capability = _CAPABILITY.match(token)
        arch = f"{capability.group(1)}{capability.group(2)}" if capability else token.lower()
        if not (_ARCH.match(arch) or arch in _CMAKE_KEYWORDS):
            raise FetchError(
                f"{ENV_CUDA_ARCHITECTURES}: {token!r} is not a CUDA architecture; {_ARCH_HINT}"
            )
        if arch not in out:
            out.append(arch)
    if not out:
        raise FetchError(f"{ENV_CUDA_ARCHITECTURES} is empty; {_ARCH_HINT}")
    return ";".join(out)


def nvml_capabilities(nvml_module: Any | None = None) -> list[str]:
    """``major.minor`` of each GPU NVML sees (empty without the driver or ``nvidia-ml-py``)."""
    nvml: Any = nvml_module
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        found = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            found.append(f"{int(major)}.{int(minor)}")
        return found
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def smi_capabilities(run: Callable[[list[str]], str] | None = None) -> list[str]:
    """``nvidia-smi --query-gpu=compute_cap``: one ``major.minor`` a GPU."""
    if run is None and shutil.which("nvidia-smi") is None:
        return []
    argv = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        text = (run or _output)(argv)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in text.splitlines() if _CAPABILITY.match(line.strip())]


def toolkit_root(nvcc: Path, run: Callable[[list[str]], str] | None = None) -> Path:
    """The CUDA toolkit ``nvcc`` belongs to, as nvcc says (``#$ TOP=...`` of a dry run, which
    sees through wrapper scripts), else the folder above its ``bin/``."""
    try:
        text = (run or _output_all)([str(nvcc), "-dryrun", "-E", "-x", "cu", os.devnull])
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1].strip()).resolve()
    return nvcc.resolve().parent.parent


def cuda_toolkit_problem(root: Path, system_lib_dirs: tuple[str, ...] | None = None) -> str | None:
    """What the CUDA toolkit at ``root`` lacks for llama.cpp's CUDA backend, or None.
    ``system_lib_dirs``: where else a driver's ``libcuda.so`` may be (default: the usual)."""
    system_lib_dirs = _SYSTEM_LIB_DIRS if system_lib_dirs is None else system_lib_dirs
    missing = []
    headers = [root / "include", *map(Path, glob.glob(str(root / "targets" / "*" / "include")))]
    if root != Path("/usr"):
        headers.append(Path("/usr/include"))  # Debian's packaged cuBLAS beside a toolkit
    if not any((d / "cublas_v2.h").is_file() for d in headers):
        missing.append("cuBLAS (cublas_v2.h)")
    stubs = [root / "lib64" / "stubs", root / "lib" / "stubs"]
    stubs += map(Path, glob.glob(str(root / "targets" / "*" / "lib" / "stubs")))
    if not any((d / "libcuda.so").exists() for d in [*stubs, *map(Path, system_lib_dirs)]):
        missing.append("the driver library (libcuda.so, or the toolkit's stub of it)")
    if not missing:
        return None
    return (
        f"the CUDA toolkit at {root} lacks {' and '.join(missing)}, which llama.cpp's cuda "
        "backend links; install the full toolkit (e.g. the cuda-toolkit package of its version)"
    )


def _output(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    return done.stdout


def _output_all(argv: list[str]) -> str:
    done = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=20, check=False
    )
    return done.stdout
