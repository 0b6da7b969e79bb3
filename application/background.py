"""Tasks that run beside an event-loop path and must neither be lost nor fail silently.

The node message loop hands store writes to such tasks so a slow store never holds it up;
the set keeps a reference to each task until it ends (asyncio keeps only weak ones), and a
task that fails is logged with what it was doing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self, what: str) -> None:
        self.what = what  # for the log line of a task that fails
        self._tasks: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", self.what, exc_info=task.exception())

    def running(self) -> list[asyncio.Future[None]]:
        """The tasks spawned so far that have not ended."""
        return list(self._tasks)

    async def settle(self) -> None:
        """Waits until every task spawned so far (and any they spawn) has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
