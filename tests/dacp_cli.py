"""``dacp`` run as its own process, as an operator runs it, for the tests of its commands."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_dacp(
    *argv: str, env: Mapping[str, str], cwd: Path = REPO, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``dacp ARGV`` with exactly ``env`` in ``cwd``: how it exited and what it printed (text)."""
    return subprocess.run(
        [sys.executable, "-m", "interfaces.cli.main", *argv],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
