"""``python -m ops.build_llama --configure-only``: CMake's configure step of the pinned llama.cpp
source, for real, in a temporary folder (seconds; nothing is compiled or cached).

The CUDA case runs where ``nvcc`` is (it needs no GPU: the architectures are given). Where the
toolkit around it is complete it must configure; where it is not (this project's machines have
``nvcc`` without cuBLAS or the driver stub), the build must refuse in one line naming what is
missing, before CMake fails on a missing ``CUDA::cublas`` target.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.runtime.llama_backend import find_nvcc
from ops.backend_flags import NO_NVCC, cuda_toolkit_problem, toolkit_root

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240


def configure(backend: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ops.build_llama", "--backend", backend, "--configure-only"]
    return subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_the_cpu_backend_configures() -> None:
    done = configure("cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "llama.cpp backend: cpu (--backend)"
    assert "Including CPU backend" in done.stdout and "Including RPC backend" in done.stdout
    assert "configured llama.cpp 11434.0.0 for cpu in " in done.stdout


def test_the_cuda_backend_configures_or_names_what_the_machine_lacks() -> None:
    """Configures where the toolkit is whole; otherwise the one-line refusal names what is
    missing (no nvcc, or the toolkit's missing parts), before any work."""
    nvcc = find_nvcc()
    problem = NO_NVCC if nvcc is None else cuda_toolkit_problem(toolkit_root(nvcc))
    done = configure("cuda", CUDA_ARCHITECTURES="90")
    if problem is None:
        assert done.returncode == 0, done.stderr
        assert "Including CUDA backend" in done.stdout
        assert "-DCMAKE_CUDA_ARCHITECTURES=90" in done.stdout
    else:
        assert done.returncode == 1
        assert done.stderr.strip() == f"build_llama: error: {problem}"
        assert "extracting" not in done.stdout  # refused before any work
