"""Start a tool whose output the caller reads line by line as it comes.

The set-up (``ops.bootstrap``, ``ops.venv_install``), the llama.cpp build (``ops.build_llama``)
and the GPU payload's ``pip download`` (``ops.gpu_payload``) each show or log a tool's lines
while it runs and keep the last ones for an error message. Standard library only: the set-up
imports this with the system ``python3`` before the venv exists.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def output_lines(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[str]:
    """Starts ``argv`` (in ``cwd``, else this process's folder), its output and errors read as
    text lines as they come (``proc.stdout``), with no input."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
    )
