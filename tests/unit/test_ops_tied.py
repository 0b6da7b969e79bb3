"""ops.tied: run a command that receives SIGTERM when its parent dies (Linux, where the
project runs and is tested)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ops import tied


def run_tied(parent: int, *command: str) -> int:
    argv = [sys.executable, "-m", "ops.tied", str(parent), "--", *command]
    return subprocess.run(argv, check=False, timeout=30).returncode


def test_the_command_runs_in_its_place() -> None:
    assert run_tied(os.getpid(), "sh", "-c", "exit 7") == 7


def test_a_parent_already_gone_stops_it_at_once() -> None:
    # PID 1 is not this test's child's parent: as if the parent died before the prctl.
    assert run_tied(1, "sh", "-c", "exit 7") == -signal.SIGTERM


def test_usage_errors_exit_2_and_a_missing_program_127() -> None:
    # Only argument errors run in this process: a valid call would set this process's own
    # parent-death signal.
    assert tied.main(["not-a-pid", "--", "true"]) == 2
    assert tied.main(["123", "true"]) == 2
    assert run_tied(os.getpid(), "/nonexistent/program") == 127
