"""The event-store mechanics under the controller's commands, and nothing of what they mean.

A command is a function that loads the aggregates it needs, calls their guarded methods and
returns every aggregate it changed. :meth:`AggregateStore.run` saves them in one transaction.
When another writer got there first (a version conflict), the command is re-run on freshly
loaded aggregates a bounded number of times: its effect is neither lost nor applied twice,
because the losing attempt recorded nothing. While the store is unreachable (the
:class:`~application.store_guard.StoreGuard`) a command fails at once.

Aggregates that mostly their own writer changes (for the controller: unfinished jobs, and
nodes) are kept as last saved, so the next command starts from them instead of a store query
and a deep copy. A write by anyone else makes the save conflict, which drops the copy and
re-runs the command on state loaded from the store.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import RecordConflictError, Recording

from application.errors import ConcurrencyExhausted, NotFound
from application.store_guard import StoreGuard

A = TypeVar("A", bound=Aggregate)

#: How many times a command is re-run after losing a concurrency race.
MAX_COMMAND_ATTEMPTS = 10
#: Aggregates kept as last saved (the oldest go first).
FRESH_MAX = 4096

#: A command: loads and changes aggregates, and returns those to save.
Command = Callable[[], Sequence[Aggregate]]
#: Called with the store position of every save (projections wake on it).
SaveListener = Callable[[int], None]


def _uuid(ident: UUID | str, kind: str) -> UUID:
    try:
        return ident if isinstance(ident, UUID) else UUID(str(ident))
    except ValueError as e:
        raise NotFound(kind, ident) from e


class FreshAggregates:
    """Aggregates as this process last saved them, checked out by the command that uses one."""

    def __init__(self, keep: Callable[[Aggregate], bool], limit: int = FRESH_MAX) -> None:
        #: Whether a saved aggregate is worth keeping (only its own writer changes it).
        self.keep = keep
        self.limit = limit
        self._saved: OrderedDict[UUID, Aggregate] = OrderedDict()
        self._lock = threading.Lock()

    def check_out(self, uid: UUID) -> Aggregate | None:
        """The kept aggregate, removed meanwhile: a command running at the same time in
        another thread loads its own copy; this one comes back only when its save succeeds."""
        with self._lock:
            return self._saved.pop(uid, None)

    def saved(self, aggregates: Sequence[Aggregate]) -> None:
        with self._lock:
            for aggregate in aggregates:
                if self.keep(aggregate):
                    self._saved[aggregate.id] = aggregate
                    self._saved.move_to_end(aggregate.id)
                else:
                    self._saved.pop(aggregate.id, None)
            while len(self._saved) > self.limit:
                self._saved.popitem(last=False)

    def forget(self, aggregates: Iterable[Aggregate]) -> None:
        with self._lock:
            for aggregate in aggregates:
                self._saved.pop(aggregate.id, None)


class AggregateStore:
    """Loads aggregates, runs commands on them and saves, for one eventsourcing ``Application``."""

    def __init__(
        self,
        app: Application[UUID],
        guard: StoreGuard,
        *,
        kinds: Mapping[type[Aggregate], str] | None = None,
        keep_fresh: Callable[[Aggregate], bool] = lambda aggregate: False,
    ) -> None:
        self.app = app
        #: What a NotFound calls an aggregate of each class (else its class name).
        self.kinds = dict(kinds or {})
        #: Fails commands fast while the store is unreachable.
        self.guard = guard
        self.fresh = FreshAggregates(keep_fresh)
        #: Called with each successful save's duration in seconds (event-store latency).
        self.append_observer: Callable[[float], None] | None = None
        self._listeners: list[SaveListener] = []
        self._listeners_lock = threading.Lock()

    # ------------------------------------------------------------- loading

    def _kind(self, cls: type[Aggregate]) -> str:
        return self.kinds.get(cls, cls.__name__)

    def get(self, cls: type[A], ident: UUID | str) -> A:
        """The aggregate as stored (NotFound when there is none)."""
        kind = self._kind(cls)
        uid = _uuid(ident, kind)
        try:
            aggregate: Any = self.app.repository.get(uid)
        except AggregateNotFoundError as e:
            raise NotFound(kind, ident) from e
        if not isinstance(aggregate, cls):
            raise NotFound(kind, ident)
        return aggregate

    def load(self, cls: type[A], ident: UUID | str) -> A:
        """For a command: the aggregate as last saved here, else as stored."""
        kept = self.fresh.check_out(_uuid(ident, self._kind(cls)))
        return kept if isinstance(kept, cls) else self.get(cls, ident)

    def find(self, cls: type[A], uid: UUID) -> A | None:
        """The stored aggregate, or None when there is none."""
        try:
            aggregate: Any = self.app.repository.get(uid)
        except AggregateNotFoundError:
            return None
        return aggregate if isinstance(aggregate, cls) else None

    # ------------------------------------------------------------- writing

    def run(self, command: Command) -> int:
        """Runs ``command`` and saves what it returns, re-running it on version conflicts;
        the store position its events reached.

        While the store is unreachable (:attr:`guard`) it raises ``StoreUnavailable`` at
        once instead of waiting for the connection pool's timeout."""
        self.guard.check()
        for attempt in range(MAX_COMMAND_ATTEMPTS):
            try:
                aggregates = command()
            except BaseException as e:
                self.guard.observe(e)
                raise
            started = time.perf_counter()
            try:
                recordings = self.app.save(*aggregates)
            except RecordConflictError:
                self.fresh.forget(aggregates)
                # Another writer won; back off a little (jittered) so the two do not
                # collide in lock-step again, then re-run on fresh state.
                time.sleep(random.uniform(0, 0.002 * 2**attempt))
                continue
            except BaseException as e:
                self.fresh.forget(aggregates)
                self.guard.observe(e)
                raise
            self.fresh.saved(aggregates)
            if self.append_observer is not None:
                self.append_observer(time.perf_counter() - started)
            if not recordings:
                return self.position()
            return max(r.notification.id for r in recordings)
        raise ConcurrencyExhausted(
            f"gave up after {MAX_COMMAND_ATTEMPTS} concurrent-write conflicts"
        )

    def change(self, cls: type[A], ident: UUID | str, act: Callable[[A], object]) -> int:
        """Runs ``act`` on one aggregate as a command (see :meth:`run`)."""

        def command() -> list[Aggregate]:
            aggregate = self.load(cls, ident)
            act(aggregate)
            return [aggregate]

        return self.run(command)

    # ------------------------------------------------------- notifications

    def position(self) -> int:
        """The store's current maximum notification id (0 when empty)."""
        return self.app.recorder.max_notification_id() or 0

    def add_save_listener(self, listener: SaveListener) -> None:
        with self._listeners_lock:
            self._listeners.append(listener)

    def remove_save_listener(self, listener: SaveListener) -> None:
        with self._listeners_lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def notify(self, recordings: list[Recording[UUID]]) -> None:
        """Tells every listener the position a save reached (the application's hook)."""
        if not recordings:
            return
        position = max(r.notification.id for r in recordings)
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(position)
