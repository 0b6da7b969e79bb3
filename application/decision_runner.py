"""Where a scheduling decision runs: on the event loop while decisions are quick, in a thread
of their own once they are not.

A decision reads every node. On a small cluster it takes a tenth of a millisecond, less than
the two thread switches a hop to a thread costs, and a warm request's first token waits for it.
On a thousand nodes it takes a few milliseconds, which the event loop should spend relaying
tokens. So the runner keeps a running average of the decisions' own time: under
:data:`INLINE_DECISION_SECONDS` they run inline; above it, in the decisions thread (one thread,
not the shared pool, where each placement of a burst waited for everyone's store writes).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Decisions that take less than this on average (s) run on the event loop.
INLINE_DECISION_SECONDS = 0.0005
#: The weight of the latest decision in the running average: a single slow one (a pause of
#: the collector) moves it a fifth of the way, and a few quick ones bring it back.
LATEST_WEIGHT = 0.2


class DecisionRunner:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        #: The running average of the decisions' own time (s).
        self.average = 0.0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement")

    @property
    def inline(self) -> bool:
        """Whether the next decision runs on the event loop."""
        return self.average < INLINE_DECISION_SECONDS

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, inline or in the decisions thread (see the module)."""
        call = functools.partial(fn, *args, **kwargs)
        if self.inline:
            return self._timed(call)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._timed, call)

    def _timed(self, call: Callable[[], T]) -> T:
        started = self._clock()
        try:
            return call()
        finally:
            took = self._clock() - started
            self.average += (took - self.average) * LATEST_WEIGHT
