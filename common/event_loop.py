"""The event loop the processes run on: uvloop where it exists (Linux, macOS), else asyncio's.

Shared by the controller and the agent (which imports only ``agent`` and ``proto``).

The controller relays every token through its loop (gRPC read, queue hand-off, HTTP write) and
the agent through its own (llama-server's SSE read, gRPC write); uvloop's loop, transports and
futures cost less CPU per token than asyncio's pure-Python ones (``make bench-capacity``).

Both processes also run store writes, projections and process management on worker threads.
A thread that holds the GIL keeps it for up to ``sys.getswitchinterval()`` (5 ms by default)
before a waiting thread gets it, so a token or a request arriving while the projection
follower works waited up to 5 ms for the loop. :data:`SWITCH_INTERVAL` bounds that wait.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: uvloop has no Windows build; there the agent runs on asyncio's own loop.
USES_UVLOOP = sys.platform != "win32"
#: Longest a worker thread keeps the GIL while the event loop waits for it (seconds).
SWITCH_INTERVAL = 0.0005


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the fastest loop this platform has, with the GIL handed to
    the loop within :data:`SWITCH_INTERVAL` (process-wide: call it from entry points only)."""
    sys.setswitchinterval(SWITCH_INTERVAL)
    if not USES_UVLOOP:
        return asyncio.run(main)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
