"""Polling for a condition in fault tests, with a limit, reporting how long it took."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(check: Callable[[], object], timeout: float = 20.0) -> float:
    """Seconds until ``check()`` is true; an error in ``check`` (the store coming back)
    counts as not yet. Fails the test after ``timeout`` seconds."""
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except Exception:
            pass
        assert time.monotonic() - started < timeout, f"condition not met in {timeout:g}s"
        await asyncio.sleep(0.05)
