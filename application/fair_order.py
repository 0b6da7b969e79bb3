"""The orders in which one model's waiting requests are served, as bookkeeping: who goes next
(:meth:`head`), the whole order the waiting set would be served in if nobody else came
(iterating, a simulation: a queue position is an index in it), and what a dispatch or a
departure changes. :class:`FifoOrder` is first in, first out; :class:`FairOrder` lets API
keys take turns within each priority class and weights the classes
(``application/admission.py`` states the rule and its bound). No clock, no I/O: each change
is O(1) (a key whose last request leaves without being served costs a scan of its class's
turns), iterating is O(waiting)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from domain.api_keys import Priority

#: Interactive dispatches in a row while a batch request waits; then one batch request goes.
INTERACTIVE_WEIGHT = 4


class Queued(Protocol):
    """A waiting request as the orders see it: its API key and the key's priority class."""

    @property
    def key(self) -> str: ...

    @property
    def priority(self) -> Priority: ...


T = TypeVar("T", bound=Queued)


class FifoOrder(Generic[T]):
    """First in, first out, whoever asks."""

    def __init__(self) -> None:
        self._queue: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[T]:
        return iter(self._queue)

    def head(self) -> T | None:
        return self._queue[0] if self._queue else None

    def add(self, item: T) -> None:
        self._queue.append(item)

    def remove(self, item: T) -> None:
        """``item`` leaves without being served (timed out, cancelled, or went first)."""
        self._queue.remove(item)

    def dispatched(self, item: T) -> None:
        self._queue.remove(item)


class _Turns(Generic[T]):
    """One priority class: each key's requests in arrival order, and the keys' turns.

    A *round* serves each key with a waiting request once. ``now`` holds the keys still to be
    served in this round, in turn order; ``later`` those served in it that wait again (for the
    next round, in the order they were served); ``served`` every key served in this round, so a
    key whose queue ran dry and fills again waits for the next round, not this one. A key that
    starts waiting joins this round at its end unless it was served in it already. The next
    round begins (``later`` becomes ``now``) when ``now`` is empty and the next key is served.
    """

    def __init__(self) -> None:
        self.keys: dict[str, deque[T]] = {}
        self.now: deque[str] = deque()
        self.later: deque[str] = deque()
        self.served: set[str] = set()
        self.count = 0

    def head(self) -> T | None:
        turns = self.now or self.later
        return self.keys[turns[0]][0] if turns else None

    def add(self, item: T) -> None:
        waiting = self.keys.get(item.key)
        if waiting is None:
            self.keys[item.key] = deque([item])
            (self.later if item.key in self.served else self.now).append(item.key)
        else:
            waiting.append(item)
        self.count += 1

    def remove(self, item: T) -> None:
        """``item`` leaves out of turn: its key's turn stays where it was."""
        waiting = self.keys[item.key]
        waiting.remove(item)
        self.count -= 1
        if not waiting:
            del self.keys[item.key]
            (self.now if item.key in self.now else self.later).remove(item.key)
        self._settle()

    def dispatched(self, item: T) -> None:
        """``item`` was served: in turn (the head) its key's turn is used; otherwise as
        :meth:`remove`."""
        if item is not self.head():
            self.remove(item)
            return
        if not self.now:  # the next round begins
            self.now, self.later = self.later, self.now
            self.served.clear()
        key = self.now.popleft()
        self.served.add(key)
        waiting = self.keys[key]
        waiting.popleft()
        self.count -= 1
        if waiting:
            self.later.append(key)
        else:
            del self.keys[key]
        self._settle()

    def _settle(self) -> None:
        if not self.count:  # nobody waits: the next to come starts afresh
            self.served.clear()

    def __iter__(self) -> Iterator[T]:
        """The order this class's requests would be served in: round after round."""
        taken: dict[str, int] = {}
        turns, upcoming = list(self.now), list(self.later)
        while turns or upcoming:
            if not turns:
                turns, upcoming = upcoming, []
            for key in turns:
                index = taken.get(key, 0)
                waiting = self.keys[key]
                yield waiting[index]
                taken[key] = index + 1
                if index + 1 < len(waiting):
                    upcoming.append(key)
            turns = []


class FairOrder(Generic[T]):
    """Keys take turns within a class (:class:`_Turns`); interactive goes before batch, but
    after :data:`INTERACTIVE_WEIGHT` interactive dispatches in a row while a batch request
    waits, the next batch request goes."""

    def __init__(self) -> None:
        self._interactive: _Turns[T] = _Turns()
        self._batch: _Turns[T] = _Turns()
        #: Interactive dispatches since the last batch one, or since batch requests wait.
        self._streak = 0

    def __len__(self) -> int:
        return self._interactive.count + self._batch.count

    def _turns(self, item: T) -> _Turns[T]:
        return self._batch if item.priority == Priority.BATCH else self._interactive

    def _batch_next(self, streak: int, interactive: int, batch: int) -> bool:
        return batch > 0 and (interactive == 0 or streak >= INTERACTIVE_WEIGHT)

    def head(self) -> T | None:
        if self._batch_next(self._streak, self._interactive.count, self._batch.count):
            return self._batch.head()
        return self._interactive.head()

    def add(self, item: T) -> None:
        turns = self._turns(item)
        if turns is self._batch and not turns.count:
            self._streak = 0
        turns.add(item)

    def remove(self, item: T) -> None:
        """``item`` leaves without being served (timed out, cancelled, or went first)."""
        self._turns(item).remove(item)

    def dispatched(self, item: T) -> None:
        turns = self._turns(item)
        if turns is self._batch:
            self._streak = 0
        elif self._batch.count:
            self._streak += 1
        turns.dispatched(item)

    def __iter__(self) -> Iterator[T]:
        """The order the waiting requests would be served in if nobody else came."""
        interactive, batch = iter(self._interactive), iter(self._batch)
        left_interactive, left_batch = self._interactive.count, self._batch.count
        streak = self._streak
        while left_interactive or left_batch:
            if self._batch_next(streak, left_interactive, left_batch):
                yield next(batch)
                left_batch -= 1
                streak = 0
            else:
                yield next(interactive)
                left_interactive -= 1
                streak += 1
