"""A circuit breaker for the event store: once it is unreachable, fail fast until it is back.

Without it, every request during a PostgreSQL outage waited for the connection pool's
timeout (10 s) before its 503, and piled up threads meanwhile. The first failure that shows
the store is unreachable (a command's, or the projection follower losing its connection)
*trips* the guard: from then on :meth:`StoreGuard.check` raises :class:`StoreUnavailable` at
once, and a prober thread asks the store (``probe``: one short connection, one query) every
``probe_interval`` seconds. The first answer closes the guard again; nothing restarts.

Only outages trip it: a refused command (a domain error, a version conflict) is the store
working as it should.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from eventsourcing.persistence import InterfaceError, OperationalError

log = logging.getLogger(__name__)

#: Seconds between probes while the store is unreachable.
PROBE_INTERVAL = 0.5


#: The OpenAI error code of a request the store's outage cost (HTTP 503 with Retry-After).
STORE_UNAVAILABLE = "store_unavailable"


class StoreUnavailable(Exception):
    """The event store is unreachable right now (HTTP 503 with ``Retry-After``)."""


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the store cannot be reached (not that it refused something);
    a guard that is already tripped (:class:`StoreUnavailable`) says so too."""
    return isinstance(exc, OperationalError | InterfaceError | ConnectionError | StoreUnavailable)


class StoreGuard:
    """Up until an outage is observed; then down until ``probe()`` answers True."""

    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        on_back: Callable[[], None] | None = None,
        probe_interval: float = PROBE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        #: Runs once the store answers again, before commands are let through (storage
        #: refreshes its connection pools, whose reconnect attempts back off meanwhile).
        self.on_back = on_back
        self.probe_interval = probe_interval
        self.clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._reason = ""
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self.trips = 0  # outages seen (for metrics and tests)

    @property
    def up(self) -> bool:
        return self._down_since is None

    def down_for(self) -> float:
        """Seconds since the store became unreachable (0 while it is up)."""
        since = self._down_since
        return 0.0 if since is None else self.clock() - since

    def check(self) -> None:
        """Raises :class:`StoreUnavailable` at once while the store is unreachable."""
        if self._down_since is not None:
            raise StoreUnavailable(f"the event store is unreachable: {self._reason}")

    def observe(self, exc: BaseException) -> None:
        """Called with every store error; trips the guard when it is an outage."""
        if isinstance(exc, StoreUnavailable) or not is_outage(exc):
            return  # tripped already, or not an outage
        with self._lock:
            if self._down_since is not None or self._closed.is_set():
                return
            self._down_since = self.clock()
            self._reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            self.trips += 1
            log.warning("event store unreachable (%s); failing fast until it answers", self._reason)
            self._prober = threading.Thread(target=self._probe, name="store-probe", daemon=True)
            self._prober.start()

    def _probe(self) -> None:
        while not self._closed.wait(self.probe_interval):
            try:
                answered = self.probe()
            except Exception:
                answered = False
            if answered and self.on_back is not None:
                try:
                    self.on_back()
                except Exception as e:
                    log.warning("event store answers, but reconnecting failed: %r", e)
                    answered = False
            if answered:
                with self._lock:
                    down = self.down_for()
                    self._down_since = None
                    self._reason = ""
                log.warning("event store reachable again after %.1fs", down)
                return

    def close(self) -> None:
        self._closed.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=5)
