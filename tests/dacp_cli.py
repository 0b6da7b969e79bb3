"""``dacp`` run as its own process, as an operator runs it, for the tests of its commands: a
command run to its end, and a long-running one (a controller, an agent) stopped."""

from __future__ import annotations

import signal
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


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals, grace: float) -> None:
    """Asks ``proc`` to stop with ``sig``; kills it if it has not ended ``grace`` seconds on."""
    proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
