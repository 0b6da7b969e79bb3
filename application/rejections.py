"""How much a node (or a caller) may cost the controller, in store writes, log lines and
replies, however many messages it sends.

:class:`RejectionAudit`: how often a refused agent message (or a refused caller) is recorded.
An agent with a bug may send thousands, and each must not cost a store write. The first
refusal of a key is recorded at once; later ones at most once every ``interval`` seconds per
key, the event counting those in between (``suppressed``). Every refusal is still counted in
/metrics.

:class:`RateBudget`: a token bucket per key (a node, a source address): ``burst`` at once,
then ``rate`` per second. What goes beyond it is counted, not acted on.

:class:`PendingGate`: how many attempts of one key, and of all, may be under way at once,
and how many may wait (briefly) for their turn.

The first two forget the keys least recently seen beyond MAX_KEYS, so neither grows with the
number of nodes or addresses that ever called; the gate keeps only the keys under way.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass

#: At most one NODE_MESSAGE_REJECTED per node (ACCESS_REFUSED per source) this often (s).
AUDIT_INTERVAL = 10.0
#: The most keys either keeps; the least recently used go first beyond it.
MAX_KEYS = 10_000


class RejectionAudit:
    def __init__(self, interval: float = AUDIT_INTERVAL, max_keys: int = MAX_KEYS) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._last: OrderedDict[str, float] = OrderedDict()
        self._suppressed: dict[str, int] = {}

    def note(self, key: str, now: float) -> int | None:
        """A refusal of ``key``'s message at ``now``: the number of refusals to report as
        suppressed when this one is to be recorded, else None (counted for the next one)."""
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            gone, _ = self._last.popitem(last=False)
            self._suppressed.pop(gone, None)
        return self._suppressed.pop(key, 0)


@dataclass
class _Bucket:
    tokens: float
    at: float
    dropped: int = 0


class RateBudget:
    """``burst`` events at once per key, then ``rate`` per second."""

    def __init__(self, rate: float, burst: int, max_keys: int = MAX_KEYS) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a budget needs a positive rate and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        """Whether ``key`` may have one more at ``now`` (False: it is over its budget, and
        this one is counted in :meth:`dropped`)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.at) * self.rate)
            bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.dropped += 1
        return False

    def dropped(self, key: str) -> int:
        """How many of ``key``'s were over budget since the last call (and resets it)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return 0
        count, bucket.dropped = bucket.dropped, 0
        return count


class PendingGate:
    """Attempts under way (callers not yet authenticated): at most ``per_key`` of one key (a
    source address) and ``total`` in all hold a place at once. One more waits for a place, up
    to ``wait`` seconds, first come first served, among at most ``waiting_per_key`` (of its
    key) and ``waiting_total`` waiting; beyond those, or once the wait is over, it is refused.
    Each :meth:`enter` that returned True is matched by one :meth:`leave`."""

    def __init__(
        self, per_key: int, total: int, *, waiting_per_key: int = 0, waiting_total: int = 0
    ) -> None:
        self.per_key = per_key
        self.total = total
        self.waiting_per_key = waiting_per_key
        self.waiting_total = waiting_total
        self._held: dict[str, int] = {}
        self._count = 0
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._waiting_of: dict[str, int] = {}

    def _room(self, key: str) -> bool:
        return self._held.get(key, 0) < self.per_key and self._count < self.total

    def _take(self, key: str) -> None:
        self._held[key] = self._held.get(key, 0) + 1
        self._count += 1

    async def enter(self, key: str, wait: float) -> bool:
        """Whether the attempt may go on (it then holds a place until :meth:`leave`)."""
        if self._room(key) and not self._waiting:
            self._take(key)
            return True
        if (
            self._waiting_of.get(key, 0) >= self.waiting_per_key
            or len(self._waiting) >= self.waiting_total
        ):
            return False
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (key, place)
        self._waiting.append(entry)
        self._waiting_of[key] = self._waiting_of.get(key, 0) + 1
        try:
            await asyncio.wait_for(asyncio.shield(place), wait)
        except TimeoutError:
            self._give_up(entry)
            return False
        except asyncio.CancelledError:
            self._give_up(entry)
            raise
        return True

    def _give_up(self, entry: tuple[str, asyncio.Future[None]]) -> None:
        key, place = entry
        if place.done() and not place.cancelled():
            self.leave(key)  # a place came just as the wait ended: hand it on
        else:
            place.cancel()
            self._forget(entry)

    def leave(self, key: str) -> None:
        held = self._held.get(key, 0)
        if held <= 1:
            self._held.pop(key, None)
        else:
            self._held[key] = held - 1
        self._count = max(0, self._count - 1)
        self._wake()

    def _forget(self, entry: tuple[str, asyncio.Future[None]]) -> None:
        try:
            self._waiting.remove(entry)
        except ValueError:
            return
        key = entry[0]
        left = self._waiting_of.get(key, 0) - 1
        if left > 0:
            self._waiting_of[key] = left
        else:
            self._waiting_of.pop(key, None)

    def _wake(self) -> None:
        """Gives free places to the first waiters that have room."""
        for entry in list(self._waiting):
            if self._count >= self.total:
                return
            key, place = entry
            if self._room(key):
                self._forget(entry)
                if not place.done():
                    self._take(key)
                    place.set_result(None)

    @property
    def pending(self) -> int:
        return self._count

    @property
    def waiting(self) -> int:
        return len(self._waiting)
