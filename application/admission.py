"""The admission queue: requests that cannot start now wait, first in first out, per model.

Only the head of a model's queue tries to place itself; everyone behind it waits, so a request
that arrives later never overtakes one that waited longer (a new arrival for a model whose
queue is not empty joins the queue instead of trying directly). Whenever capacity may have
changed (a job ended, a node became ready) the job manager calls :meth:`AdmissionQueue.wake`,
which wakes each head; a head that finds no room goes back to waiting. Deadlines and the
recording of ``JOB_QUEUED`` belong to the job manager: this module is bookkeeping only, with
no clock and no I/O, so it is tested without sleeping.

One exception to first in, first out, with a bound: the caches. A waiting conversation whose
prefix a busy server holds may let a free slot elsewhere go by, waiting for its own server, and
a free slot whose server holds a waiting conversation's prefix may go to that conversation
before the head (:meth:`AdmissionQueue.promote`; the job setup decides with the prefix router,
:meth:`application.prefix_routing.PrefixRouter.next_to_go`). Only the :data:`REORDER_WINDOW`
requests behind the head may go first, and each request *passes* (lets a free slot go by, or a
later request go before it) at most :data:`MAX_PASSES` times: after that it takes the next free
slot, whatever the caches hold, and nobody behind it goes first. So a request waits at most
``MAX_PASSES`` slot releases longer than in strict FIFO order, and the queue position it
reported at joining is off by at most that much.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from application.errors import ApplicationError
from common.contract import JobErrorCode

DEFAULT_QUEUE_MAX = 512
DEFAULT_QUEUE_TIMEOUT = 120.0
#: The most times one waiting request lets a free slot, or a later request, go first
#: (see the module's docstring): about one round of a small cluster's slots.
MAX_PASSES = 8
#: How far behind the head a request may be and still go first: a bound on the work of
#: matching waiting prompts against the caches each time a slot comes free.
REORDER_WINDOW = 16


class CapacityError(ApplicationError):
    """The request cannot run now; HTTP 503 with ``Retry-After`` and an OpenAI error code."""

    code: str = JobErrorCode.NO_CAPACITY

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(CapacityError):
    code = JobErrorCode.QUEUE_FULL


class QueueTimeoutError(CapacityError):
    code = JobErrorCode.QUEUE_TIMEOUT


@dataclass(eq=False)
class Ticket:
    """One waiting request. ``wakeup`` is set when it should try to place itself again;
    ``chain`` is its prompt's prefix chain (:meth:`PrefixRouter.chain`, empty when not routed);
    ``passes`` counts the free slots and later requests it let go first."""

    model: str
    job_id: str
    position: int
    chain: tuple[int, ...] = ()
    passes: int = 0
    #: The capacity change (:meth:`AdmissionQueue.wake`) it last let a free slot go by at.
    passed_at: int = -1
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


def may_pass(ticket: Ticket) -> bool:
    """Whether ``ticket`` may still let a free slot or a later request go first."""
    return ticket.passes < MAX_PASSES


class AdmissionQueue:
    def __init__(self, max_waiting: int = DEFAULT_QUEUE_MAX) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self._queues: dict[str, deque[Ticket]] = {}
        self._waiting = 0
        #: Capacity changes so far (:meth:`wake` with no model): a request lets the free slots
        #: of one change go by once, however often it is asked meanwhile.
        self._changes = 0

    def __len__(self) -> int:
        return self._waiting

    def depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def depths(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self._queues.items() if queue}

    def join(self, model: str, job_id: str, chain: tuple[int, ...] = ()) -> Ticket:
        """Appends a request; raises :class:`QueueFullError` when ``max_waiting`` wait already."""
        if self._waiting >= self.max_waiting:
            raise QueueFullError(
                f"the admission queue is full ({self.max_waiting} requests waiting); "
                "retry later or raise QUEUE_MAX",
                retry_after=10,
            )
        queue = self._queues.setdefault(model, deque())
        ticket = Ticket(model, job_id, position=len(queue) + 1, chain=chain)
        queue.append(ticket)
        self._waiting += 1
        if len(queue) == 1:
            ticket.wakeup.set()  # nobody ahead: try at once
        elif chain:
            queue[0].wakeup.set()  # a free slot may have waited for this conversation
        return ticket

    def is_head(self, ticket: Ticket) -> bool:
        queue = self._queues.get(ticket.model)
        return queue is not None and bool(queue) and queue[0] is ticket

    def overtakers(self, head: Ticket) -> list[Ticket]:
        """The requests that may go before ``head`` (the head of its queue), in queue order:
        within :data:`REORDER_WINDOW` of it, and only while every request they would pass has
        passed fewer than :data:`MAX_PASSES` times. Empty when ``head`` is not the head."""
        if not self.is_head(head):
            return []
        queue = self._queues[head.model]
        found: list[Ticket] = []
        for index, ticket in enumerate(queue):
            if index > REORDER_WINDOW:
                break
            if index > 0:
                found.append(ticket)
            if not may_pass(ticket):
                break  # nobody behind it may pass it
        return found

    def promote(self, ticket: Ticket) -> None:
        """``ticket`` (one of :meth:`overtakers`) goes first: it becomes the head and is woken;
        each request it goes before counts one more pass."""
        queue = self._queues.get(ticket.model)
        if not queue or queue[0] is ticket:
            return
        if ticket not in self.overtakers(queue[0]):
            raise ValueError(f"job {ticket.job_id} may not go first: it would pass the bound")
        for passed in queue:
            if passed is ticket:
                break
            passed.passes += 1
        queue.remove(ticket)
        queue.appendleft(ticket)
        ticket.wakeup.set()

    def passed(self, tickets: list[Ticket]) -> None:
        """Each of ``tickets`` let a free slot go by, waiting for its own server: one pass per
        capacity change, however many times it is asked meanwhile (new arrivals ask too)."""
        for ticket in tickets:
            if ticket.passed_at != self._changes:
                ticket.passed_at = self._changes
                ticket.passes += 1

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
        self._changes += 1
        if model is not None:
            queues = [self._queues[model]] if model in self._queues else []
        else:
            queues = list(self._queues.values())
        for queue in queues:
            if queue:
                queue[0].wakeup.set()
