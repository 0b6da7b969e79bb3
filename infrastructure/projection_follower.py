"""Keeps the read-model views following the event store, live.

The follower reads the notification log in batches and applies each batch with its tracking
records in one transaction (a row that several events of the batch change is read and written
once): exactly once, resumable after a restart, and cheap enough to keep up with thousands of
events a second. It is woken at once by this process's saves; on Postgres also by
eventsourcing's LISTEN/NOTIFY subscription (other controllers' writes), and on SQLite, which
has none, every ``poll_interval``. A batch that fails is applied again one event at a time, so
one event the views cannot take, or one that another follower applied first, is found alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from eventsourcing.persistence import IntegrityError, Tracking

from application.controller import Controller
from application.store_guard import is_outage
from infrastructure.read_model_store import ReadModelStore

log = logging.getLogger(__name__)

BATCH = 500
#: Attempts before an event that cannot be applied is skipped (and logged) by the views.
#: Only failures of the event itself count: an unreachable store is retried for as long as
#: it lasts, and never makes the views skip anything.
POISON_AFTER = 3
#: Backoff between attempts after a failure (seconds): doubles from the first to the last.
RETRY_FIRST, RETRY_MAX = 0.2, 5.0


class ProjectionFollower:
    def __init__(
        self, app: Controller, store: ReadModelStore, *, poll_interval: float = 0.5
    ) -> None:
        self.app = app
        self.store = store
        self.poll_interval = poll_interval
        self._position = store.max_tracking_id(store.view_name) or 0
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscription: Any = None
        self._event_listeners: list[Callable[[int, object], None]] = []
        self._failures: dict[int, int] = {}
        #: Events the views skipped (notification ids), recorded in the store (``skips``).
        self.skipped: list[int] = _recorded_skips(store)
        #: The error the follower is retrying after ("" while it keeps up).
        self.error = ""
        self.uses_subscription = app.factory.env.get("PERSISTENCE_MODULE") == (
            "eventsourcing.postgres"
        )

    @property
    def position(self) -> int:
        """The last store position applied to the views."""
        return self._position

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.app.add_save_listener(self._on_save)
        self._thread = threading.Thread(target=self._run, name="projection-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.app.remove_save_listener(self._on_save)
        if self._subscription is not None:
            self._subscription.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def add_event_listener(self, listener: Callable[[int, object], None]) -> None:
        """Calls ``listener(position, event)`` for each event once the views reflect it and
        before :meth:`wait` reports its position (from the follower's thread; listeners must
        be quick and thread-safe)."""
        self._event_listeners.append(listener)

    def _on_save(self, position: int) -> None:
        self._wake.set()

    def _run(self) -> None:
        delay = RETRY_FIRST
        while not self._stop.is_set():
            try:
                if self.uses_subscription:
                    self._follow_subscription()
                else:
                    self._follow_log()
            except Exception as e:
                if self._stop.is_set():
                    return
                self.app.guard.observe(e)  # a lost connection: requests fail fast meanwhile
                if not self.error:
                    log.exception("projection follower failed; retrying with backoff")
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self._stop.wait(delay)
                delay = min(RETRY_MAX, delay * 2)
            else:
                delay = RETRY_FIRST

    def _follow_log(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.catch_up()
            # A save while it caught up set the wake again: then this returns at once.
            self._wake.wait(self.poll_interval)

    def _follow_subscription(self) -> None:
        self.catch_up()
        subscription = self.app.recorder.subscribe(gt=self._position)
        self._subscription = subscription  # before checking _stop: stop() sets it first
        with subscription:
            if self._stop.is_set():
                return
            for notification in subscription:
                if self._stop.is_set():
                    break
                if notification.id > self._position:
                    self.catch_up()  # this one and whatever else is stored by now

    # ------------------------------------------------------------- applying

    def catch_up(self) -> int:
        """Applies every recorded event not yet applied; returns how many it applied.

        A batch shorter than :data:`BATCH` was all the store held: the follower does not
        read again to learn that nothing follows (that read was two of every three the
        follower made under load). What is saved meanwhile wakes it again."""
        applied = 0
        while True:
            notifications = self.app.recorder.select_notifications(
                start=self._position + 1, limit=BATCH
            )
            if notifications:
                self._apply_batch(notifications)
                applied += len(notifications)
            if len(notifications) < BATCH:
                if self.error:
                    log.warning("projection follower caught up again after: %s", self.error)
                    self.error = ""
                return applied

    def _apply_batch(self, notifications: Sequence[Any]) -> None:
        fresh = [n for n in notifications if n.id > self._position]
        if not fresh:
            return
        events = [(n.id, self.app.mapper.to_domain_event(n)) for n in fresh]
        try:
            self.store.process_events(
                [(event, Tracking(self.store.view_name, ident)) for ident, event in events]
            )
        except Exception:
            log.debug("batch of %d events failed; applying one at a time", len(fresh))
            for notification in fresh:
                self._apply(notification)
            return
        for ident, event in events:
            self._applied(ident, event)

    def _apply(self, notification: Any) -> None:
        if notification.id <= self._position:
            return
        event = self.app.mapper.to_domain_event(notification)
        tracking = Tracking(self.store.view_name, notification.id)
        try:
            self.store.process_event(event, tracking)
        except IntegrityError:
            # Already applied (another follower or an earlier run): tracking says so.
            log.debug("notification %s already applied", notification.id)
        except Exception as e:
            if is_outage(e):
                raise  # the store, not the event: retried for as long as it lasts
            failures = self._failures.get(notification.id, 0) + 1
            self._failures = {notification.id: failures}
            if failures < POISON_AFTER:
                raise
            # One event the views cannot take must not freeze them for every later one.
            log.error(
                "read models skip event %s (%s of %s) after %d failures; "
                "`dacp projections rebuild` once the cause is fixed",
                notification.id,
                type(event).__qualname__,
                notification.originator_id,
                failures,
                exc_info=True,
            )
            self.skipped.append(notification.id)
            skip = {
                "notification_id": notification.id,
                "originator_id": str(notification.originator_id),
                "originator_version": notification.originator_version,
                "event": type(event).__qualname__,
                "error": f"{type(e).__name__}: {e}",
                "skipped_at": datetime.now(UTC).isoformat(),
            }
            self.store.record_skip(tracking, skip)
        self._applied(notification.id, event)

    def _applied(self, position: int, event: object) -> None:
        # Listeners first: whoever waits for this position sees their copies updated too.
        for listener in self._event_listeners:
            try:
                listener(position, event)
            except Exception:
                log.exception("event listener failed")
        with self._cond:
            self._position = position
            self._cond.notify_all()

    def wait(self, position: int, timeout: float = 5.0) -> None:
        """Blocks until the views reflect ``position`` (read-your-writes)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._position < position:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"read model at position {self._position} did not reach {position} "
                        f"within {timeout:.1f} s"
                    )
                self._wake.set()
                self._cond.wait(min(remaining, 0.25))


def _recorded_skips(store: ReadModelStore) -> list[int]:
    try:
        return [int(skip["notification_id"]) for skip in store.list_skips()]
    except Exception as e:  # the store is down: the count starts from this run's skips
        log.warning("cannot read the events the views skipped: %r", e)
        return []


def rebuild(app: Controller, store: ReadModelStore) -> int:
    """Empties ``store`` and re-applies the whole store from position zero."""
    store.clear()
    follower = ProjectionFollower(app, store)
    return follower.catch_up()
