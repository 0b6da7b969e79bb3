"""The admission queue: requests that cannot start now wait, first in first out, per model.

Only the head of a model's queue tries to place itself; everyone behind it waits, so a request
that arrives later never overtakes one that waited longer (a new arrival for a model whose
queue is not empty joins the queue instead of trying directly). Whenever capacity may have
changed (a job ended, a node became ready) the job manager calls :meth:`AdmissionQueue.wake`,
which wakes each head; a head that finds no room goes back to waiting. Deadlines and the
recording of ``JOB_QUEUED`` belong to the job manager: this module is bookkeeping only, with
no clock and no I/O, so it is tested without sleeping.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from application.errors import ApplicationError

DEFAULT_QUEUE_MAX = 512
DEFAULT_QUEUE_TIMEOUT = 120.0


class CapacityError(ApplicationError):
    """The request cannot run now; HTTP 503 with ``Retry-After`` and an OpenAI error code."""

    code = "no_capacity"

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(CapacityError):
    code = "queue_full"


class QueueTimeoutError(CapacityError):
    code = "queue_timeout"


@dataclass(eq=False)
class Ticket:
    """One waiting request. ``wakeup`` is set when it should try to place itself again."""

    model: str
    job_id: str
    position: int
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class AdmissionQueue:
    def __init__(self, max_waiting: int = DEFAULT_QUEUE_MAX) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self._queues: dict[str, deque[Ticket]] = {}
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def depths(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self._queues.items() if queue}

    def join(self, model: str, job_id: str) -> Ticket:
        """Appends a request; raises :class:`QueueFullError` when ``max_waiting`` wait already."""
        if self._waiting >= self.max_waiting:
            raise QueueFullError(
                f"the admission queue is full ({self.max_waiting} requests waiting); "
                "retry later or raise QUEUE_MAX",
                retry_after=10,
            )
        queue = self._queues.setdefault(model, deque())
        ticket = Ticket(model, job_id, position=len(queue) + 1)
        queue.append(ticket)
        self._waiting += 1
        if len(queue) == 1:
            ticket.wakeup.set()  # nobody ahead: try at once
        return ticket

    def is_head(self, ticket: Ticket) -> bool:
        queue = self._queues.get(ticket.model)
        return queue is not None and bool(queue) and queue[0] is ticket

    def leave(self, ticket: Ticket) -> None:
        """Removes a ticket (placed, timed out or cancelled); wakes the next head. Idempotent."""
        queue = self._queues.get(ticket.model)
        if not queue or ticket not in queue:
            return
        was_head = queue[0] is ticket
        queue.remove(ticket)
        self._waiting -= 1
        if not queue:
            del self._queues[ticket.model]
        elif was_head:
            queue[0].wakeup.set()

    def wake(self, model: str | None = None) -> None:
        """Capacity may have changed: the head of ``model``'s queue (of every queue) tries."""
        if model is not None:
            queues = [self._queues[model]] if model in self._queues else []
        else:
            queues = list(self._queues.values())
        for queue in queues:
            if queue:
                queue[0].wakeup.set()
