"""The admission queue: requests that cannot start now wait, per model, in a fair order.

Only the head of a model's queue (the first in its order) tries to place itself; everyone
else waits, and a new request for a model whose queue is not empty joins the queue instead of
trying directly. Whenever capacity may have changed (a job ended, a node became ready) the job
manager calls :meth:`AdmissionQueue.wake`, which wakes each head; a head that finds no room
goes back to waiting. Deadlines and the recording of ``JOB_QUEUED`` belong to the job manager:
this module is bookkeeping only, with no clock and no I/O, so it is tested without sleeping.

**The fair order** (``FAIR_QUEUEING``, on by default; off, a model's queue is first in, first
out). Each request carries its API key's :class:`~domain.api_keys.Grant`: its key and its
priority class, ``interactive`` or ``batch``. Within a class, keys take turns: deficit round
robin over one first-in-first-out queue per key, with a quantum of one request and every
request costing one (how long a request will run is unknown while it waits). A *round* serves
each key that has a request waiting once; a key that starts waiting joins the current round
at its end, unless it was served in this round already, and then waits for the next
(:mod:`application.fair_order`). Between the classes, a weighted round robin: interactive
requests go first, but after :data:`~application.fair_order.INTERACTIVE_WEIGHT` (4)
interactive dispatches in a row while a batch request waits, the next batch request goes, so
batch is never starved and gets at least a fifth of the dispatches while both classes wait.

The bound, for a request *r* from the moment it is the oldest waiting request of its key
(FIFO holds within a key) until it is dispatched: every other key of its class is dispatched
at most once; so with *K* keys waiting in its class, *r* waits for at most *K - 1* dispatches
of its class, plus for interactive *r* at most one batch dispatch per 4 interactive ones
(at most ``K - 1 + (K - 1) // 4 + 1`` in all), for batch *r* at most 4 interactive dispatches
before each batch one (at most ``K - 1 + 4K``). A key with 500 requests waiting delays another
key's next request by one dispatch, not 500. A request's queue position (``JOB_QUEUED``) is
how many requests the fair order serves before it, plus one, as the waiting set stands when it
joins (:meth:`AdmissionQueue.position` simulates the order); requests that come later may
still go before it, each key at most once per round.

One exception to that order, with a bound: the caches. A waiting conversation whose prefix a
busy server holds may let a free slot elsewhere go by, waiting for its own server, and a free
slot whose server holds a waiting conversation's prefix may go to that conversation before
the head (:meth:`AdmissionQueue.promote`; the job setup decides with the prefix router,
:meth:`application.prefix_routing.PrefixRouter.next_to_go`). Only the :data:`REORDER_WINDOW`
requests behind the head in the queue's order (the fair order, or arrival order when it is
off) may go first, and each request *passes* (lets a free slot go by, or a later request go
before it) at most :data:`MAX_PASSES` times: after that it takes the next free slot, whatever
the caches hold, and nobody behind it goes first. So a request waits at most ``MAX_PASSES``
dispatches longer than the order alone would make it wait (the bound above), and the queue
position it reported at joining is off by at most that much, besides the later arrivals the
fair order lets go first. A request that went first is dispatched out of turn: its key's
turn stays where it was.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from application.errors import ApplicationError
from application.fair_order import FairOrder, FifoOrder
from common.contract import JobErrorCode
from domain.api_keys import OPEN, OPEN_KEY_ID, Grant, Priority

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
    ``key`` and ``priority`` its API key's; ``position`` where it joined (1: nobody ahead);
    ``passes`` counts the free slots and later requests it let go first."""

    model: str
    job_id: str
    position: int
    chain: tuple[int, ...] = ()
    key: str = OPEN_KEY_ID
    priority: Priority = Priority.INTERACTIVE
    passes: int = 0
    #: The capacity change (:meth:`AdmissionQueue.wake`) it last let a free slot go by at.
    passed_at: int = -1
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


def may_pass(ticket: Ticket) -> bool:
    """Whether ``ticket`` may still let a free slot or a later request go first."""
    return ticket.passes < MAX_PASSES


class _ModelQueue:
    """One model's waiting requests: those that went first (the latest first), then the rest
    in the queue's order."""

    def __init__(self, fair: bool) -> None:
        self.went_first: deque[Ticket] = deque()
        self.order: FairOrder[Ticket] | FifoOrder[Ticket] = FairOrder() if fair else FifoOrder()

    def __len__(self) -> int:
        return len(self.went_first) + len(self.order)

    def __iter__(self) -> Iterator[Ticket]:
        return itertools.chain(self.went_first, self.order)

    def head(self) -> Ticket | None:
        return self.went_first[0] if self.went_first else self.order.head()

    def take(self, ticket: Ticket, *, dispatched: bool) -> None:
        if ticket in self.went_first:
            self.went_first.remove(ticket)  # out of turn: the order's turns stay as they were
        elif dispatched:
            self.order.dispatched(ticket)
        else:
            self.order.remove(ticket)


class AdmissionQueue:
    def __init__(self, max_waiting: int = DEFAULT_QUEUE_MAX, *, fair: bool = True) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        #: Keys take turns (the module's docstring); False: first in, first out.
        self.fair = fair
        self._queues: dict[str, _ModelQueue] = {}
        self._waiting: set[Ticket] = set()
        #: Capacity changes so far (:meth:`wake` with no model): a request lets the free slots
        #: of one change go by once, however often it is asked meanwhile.
        self._changes = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def depths(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self._queues.items() if queue}

    def join(
        self, model: str, job_id: str, chain: tuple[int, ...] = (), grant: Grant = OPEN
    ) -> Ticket:
        """Adds a request with ``grant``'s key and priority; raises :class:`QueueFullError`
        when ``max_waiting`` wait already. Its ``position`` is where the order puts it."""
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(
                f"the admission queue is full ({self.max_waiting} requests waiting); "
                "retry later or raise QUEUE_MAX",
                retry_after=10,
            )
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue(self.fair)
        ticket = Ticket(
            model, job_id, position=0, chain=chain, key=grant.key_id, priority=grant.priority
        )
        head = queue.head()
        queue.order.add(ticket)
        self._waiting.add(ticket)
        ticket.position = self.position(ticket) if self.fair else len(queue)
        new_head = queue.head()
        if new_head is not head or chain:
            # Nobody ahead (or it goes before the head): it tries at once; or a free slot
            # may have waited for this conversation, which the head decides.
            assert new_head is not None
            new_head.wakeup.set()
        return ticket

    def position(self, ticket: Ticket) -> int:
        """How many waiting requests go before ``ticket`` if nobody else comes, plus one;
        raises :class:`ValueError` when it does not wait."""
        queue = self._queues.get(ticket.model)
        if queue is not None and ticket in self._waiting:
            for index, waiting in enumerate(queue, start=1):
                if waiting is ticket:
                    return index
        raise ValueError(f"job {ticket.job_id} does not wait")

    def is_head(self, ticket: Ticket) -> bool:
        queue = self._queues.get(ticket.model)
        return queue is not None and queue.head() is ticket

    def overtakers(self, head: Ticket) -> list[Ticket]:
        """The requests that may go before ``head`` (the head of its queue), in the queue's
        order: within :data:`REORDER_WINDOW` of it, and only while every request they would
        pass has passed fewer than :data:`MAX_PASSES` times. Empty when ``head`` is not the
        head."""
        if not self.is_head(head):
            return []
        found: list[Ticket] = []
        for index, ticket in enumerate(
            itertools.islice(self._queues[head.model], REORDER_WINDOW + 1)
        ):
            if index > 0:
                found.append(ticket)
            if not may_pass(ticket):
                break  # nobody behind it may pass it
        return found

    def promote(self, ticket: Ticket) -> None:
        """``ticket`` (one of :meth:`overtakers`) goes first: it becomes the head and is woken;
        each request it goes before counts one more pass."""
        queue = self._queues.get(ticket.model)
        head = queue.head() if queue is not None else None
        if queue is None or head is None or head is ticket:
            return
        if ticket not in self.overtakers(head):
            raise ValueError(f"job {ticket.job_id} may not go first: it would pass the bound")
        for passed in queue:
            if passed is ticket:
                break
            passed.passes += 1
        queue.take(ticket, dispatched=False)
        queue.went_first.appendleft(ticket)
        ticket.wakeup.set()

    def passed(self, tickets: list[Ticket]) -> None:
        """Each of ``tickets`` let a free slot go by, waiting for its own server: one pass per
        capacity change, however many times it is asked meanwhile (new arrivals ask too)."""
        for ticket in tickets:
            if ticket.passed_at != self._changes:
                ticket.passed_at = self._changes
                ticket.passes += 1

    def dispatched(self, ticket: Ticket) -> None:
        """``ticket`` was placed: it leaves and its key's turn is used (when it was the head
        in the order's turn). Idempotent."""
        self._take(ticket, dispatched=True)

    def leave(self, ticket: Ticket) -> None:
        """Removes a ticket (placed, timed out or cancelled) without using its key's turn;
        wakes the next head. Idempotent."""
        self._take(ticket, dispatched=False)

    def _take(self, ticket: Ticket, *, dispatched: bool) -> None:
        queue = self._queues.get(ticket.model)
        if queue is None or ticket not in self._waiting:
            return
        head = queue.head()
        queue.take(ticket, dispatched=dispatched)
        self._waiting.discard(ticket)
        new_head = queue.head()
        if new_head is None:
            del self._queues[ticket.model]
        elif new_head is not head:
            new_head.wakeup.set()

    def wake(self, model: str | None = None) -> None:
        """Capacity may have changed: the head of ``model``'s queue (of every queue) tries."""
        self._changes += 1
        if model is not None:
            queues = [self._queues[model]] if model in self._queues else []
        else:
            queues = list(self._queues.values())
        for queue in queues:
            head = queue.head()
            if head is not None:
                head.wakeup.set()
