"""The processes' event loop: uvloop on this platform, the GIL handed over quickly."""

from __future__ import annotations

import asyncio
import sys

from common import event_loop


def test_run_uses_uvloop_and_a_short_switch_interval() -> None:
    before = sys.getswitchinterval()

    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    try:
        module = event_loop.run(loop_type())
        assert sys.getswitchinterval() == event_loop.SWITCH_INTERVAL
    finally:
        sys.setswitchinterval(before)
    assert event_loop.USES_UVLOOP  # Linux
    assert module.startswith("uvloop")
