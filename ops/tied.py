"""Run a command that dies with the process that started it (Linux), without a ``preexec_fn``.

    python -m ops.tied PARENT_PID -- COMMAND [ARG ...]

Sets ``PR_SET_PDEATHSIG`` = SIGTERM for itself, exits at once if ``PARENT_PID`` is no longer its
parent, then ``exec``s ``COMMAND``: the setting survives ``exec``, so the command receives
SIGTERM when its parent dies, even by SIGKILL. The local cluster starts its controller and agents
this way (see ``agent/runtime/child_process.py`` for why not with a ``preexec_fn``). Elsewhere than
Linux it only ``exec``s the command.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from agent.runtime.child_process import set_parent_death_signal


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -m ops.tied PARENT_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent, command = int(args[0]), args[2:]
    set_parent_death_signal(signal.SIGTERM, parent)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"ops.tied: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
