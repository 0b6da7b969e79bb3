"""Which llama.cpp backend a machine builds and runs: ``cpu``, ``cuda``, ``vulkan`` or ``metal``.

One rule for the build (``python -m ops.build_llama``) and the agent (``--llama-backend``):
a backend named on the command line wins, then ``$LLAMA_BACKEND``, then the machine decides
(:func:`detect_backend`):

- an NVIDIA GPU (NVML sees one) and ``nvcc`` (on ``PATH``, ``$CUDACXX``, ``$CUDA_HOME`` or
  ``/usr/local/cuda``) → ``cuda``;
- a Vulkan GPU (``vulkaninfo --summary`` lists a device that is not a CPU), the Vulkan headers
  and ``glslc`` → ``vulkan``;
- macOS → ``metal``;
- otherwise ``cpu`` (a machine with ``nvcc`` but no GPU gets ``cpu``: nothing could run it).

Each backend's build is cached on its own: the CPU build where it always was
(``llama.cpp/<version>/``), the others beside it (``llama.cpp/<version>-cuda/``, ...).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU = "cpu"
CUDA = "cuda"
VULKAN = "vulkan"
METAL = "metal"
#: The backends this project builds, in the order auto-detection considers them.
BACKENDS: tuple[str, ...] = (CPU, CUDA, VULKAN, METAL)
#: An operator's own build (``--llama-bin-dir``): its backend is whatever it was built with.
CUSTOM = "custom"
AUTO = "auto"
ENV_BACKEND = "LLAMA_BACKEND"
ENV_CUDA_ARCHITECTURES = "CUDA_ARCHITECTURES"


class BackendError(ValueError):
    """A backend name that is not one of :data:`BACKENDS` (or ``auto``)."""


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: str
    #: Why: "--llama-backend", "$LLAMA_BACKEND" or what the machine has.
    why: str


def backend_dir_name(version: str, backend: str) -> str:
    """The build cache's folder for ``backend`` (the CPU build keeps the historical name)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown llama.cpp backend {backend!r}; one of {', '.join(BACKENDS)}")
    return version if backend == CPU else f"{version}-{backend}"


def find_nvcc(env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    candidates: list[str | None] = [env.get("CUDACXX"), shutil.which("nvcc")]
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def nvidia_gpu_count(
    nvml_module: Any | None = None, run: Callable[[list[str]], str] | None = None
) -> int:
    """How many NVIDIA GPUs NVML sees (0 without the driver). Without ``nvidia-ml-py`` (the
    build runs with the system ``python3``, before the venv exists), ``nvidia-smi -L`` counts
    them, so ``make llama`` and the agent choose alike."""
    nvml: Any = nvml_module
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError:
            return _smi_gpu_count(run)
    try:
        nvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _smi_gpu_count(run: Callable[[list[str]], str] | None = None) -> int:
    if run is None and shutil.which("nvidia-smi") is None:
        return 0
    try:
        text = (run or _output)(["nvidia-smi", "-L"])
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in text.splitlines() if line.startswith("GPU "))


def vulkan_gpu_present(run: Callable[[list[str]], str] | None = None) -> bool:
    """``vulkaninfo --summary`` lists a device that is not a CPU (lavapipe is one)."""
    if shutil.which("vulkaninfo") is None and run is None:
        return False
    try:
        text = (run or _output)(["vulkaninfo", "--summary"])
    except (OSError, subprocess.SubprocessError):
        return False
    types = [line.split("=", 1)[1].strip() for line in text.splitlines() if "deviceType" in line]
    return any(t != "PHYSICAL_DEVICE_TYPE_CPU" for t in types)


def vulkan_sdk_present() -> bool:
    """The Vulkan headers and ``glslc`` (the shader compiler the build needs)."""
    headers = any(
        Path(d, "vulkan", "vulkan.h").is_file()
        for d in (
            os.environ.get("VULKAN_SDK", "") + "/include",
            "/usr/include",
            "/usr/local/include",
        )
    )
    return headers and shutil.which("glslc") is not None


def _output(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    return done.stdout


def detect_backend(
    *,
    platform: str = sys.platform,
    nvidia_gpus: Callable[[], int] = nvidia_gpu_count,
    nvcc: Callable[[], Path | None] = find_nvcc,
    vulkan_gpu: Callable[[], bool] = vulkan_gpu_present,
    vulkan_sdk: Callable[[], bool] = vulkan_sdk_present,
) -> BackendChoice:
    """What this machine can build and run (see the module docstring)."""
    gpus = nvidia_gpus()
    compiler = nvcc()
    if gpus and compiler is not None:
        return BackendChoice(CUDA, f"{gpus} NVIDIA GPU(s) and nvcc at {compiler}")
    if vulkan_gpu() and vulkan_sdk():
        return BackendChoice(VULKAN, "a Vulkan GPU, the Vulkan headers and glslc")
    if platform == "darwin":
        return BackendChoice(METAL, "macOS")
    if gpus:
        why = f"{gpus} NVIDIA GPU(s) but no nvcc (install the CUDA toolkit for the cuda backend)"
    elif compiler is not None:
        why = f"nvcc at {compiler} but no NVIDIA GPU"
    else:
        why = "no GPU this project can build for"
    return BackendChoice(CPU, why)


def choose_backend(
    requested: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    detect: Callable[[], BackendChoice] = detect_backend,
    flag: str = "--llama-backend",
) -> BackendChoice:
    """The backend named by ``requested`` (a flag), else ``$LLAMA_BACKEND``, else detected.
    ``auto`` (or empty) defers to the next source. Raises :class:`BackendError`."""
    env = os.environ if env is None else env
    for value, source in ((requested, flag), (env.get(ENV_BACKEND), f"${ENV_BACKEND}")):
        name = (value or "").strip().lower()
        if not name or name == AUTO:
            continue
        if name not in BACKENDS:
            raise BackendError(
                f"{source}={value!r} is not a llama.cpp backend; one of "
                f"{', '.join((*BACKENDS, AUTO))}"
            )
        return BackendChoice(name, source)
    return detect()
