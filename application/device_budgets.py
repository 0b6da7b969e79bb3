"""Device budgets lowered after an out-of-memory: what a plan may give a device for a while.

llama.cpp reports free memory per device, but what a device can really take for a model also
depends on what else runs there (another process's allocations, the driver's own reserve, a
fragmented heap, an ``RLIMIT_AS`` on an RPC worker). When a participant runs out of memory
(:data:`common.contract.OUT_OF_MEMORY`), the controller lowers that device's budget to a fraction of
what the failed plan gave it, for :data:`DEFAULT_BUDGET_SECONDS`, and plans again: the next
plan gives that device less (or leaves it out) instead of failing the same way. Another
out-of-memory on the same device lowers it further; the budget lapses when its time is up
(the node may have been freed meanwhile).

Keyed by ``(node_id, device)`` where ``device`` is the device's name on its node (``CUDA0``,
``CPU`` for the host). Pure bookkeeping with an injected clock: no I/O, no sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: How long a lowered budget holds (seconds).
DEFAULT_BUDGET_SECONDS = 600.0
#: The lowered budget, as a fraction of what the failed plan gave the device.
LOWERED_FRACTION = 0.75
#: No budget is lowered below this (a device that cannot take 16 MiB takes nothing useful).
MIN_BUDGET_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LoweredBudget:
    node_id: str
    device: str
    budget_bytes: int
    until: float
    #: What the failed plan gave the device, and what llama.cpp said it asked for (0: unsaid).
    planned_bytes: int
    asked_bytes: int


class DeviceBudgets:
    """The lowered budgets in force, by node and device."""

    def __init__(
        self,
        *,
        seconds: float = DEFAULT_BUDGET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if seconds <= 0:
            raise ValueError(f"a lowered budget must hold for a positive time, got {seconds}")
        self.seconds = seconds
        self.clock = clock
        self._lowered: dict[tuple[str, str], LoweredBudget] = {}
        #: Bumped on every change: callers that cache what they derived from budgets key on it.
        self.version = 0

    def lower(
        self, node_id: str, device: str, planned_bytes: int, asked_bytes: int = 0
    ) -> LoweredBudget:
        """``device`` of ``node_id`` ran out of memory with ``planned_bytes`` planned on it."""
        now = self.clock()
        current = self.cap(node_id, device, now)
        base = planned_bytes if planned_bytes > 0 else asked_bytes
        if current is not None:
            base = min(base, current) if base > 0 else current
        budget = max(MIN_BUDGET_BYTES, int(base * LOWERED_FRACTION)) if base > 0 else 0
        lowered = LoweredBudget(
            node_id=node_id,
            device=device,
            budget_bytes=budget,
            until=now + self.seconds,
            planned_bytes=planned_bytes,
            asked_bytes=asked_bytes,
        )
        self._lowered[(node_id, device)] = lowered
        self.version += 1
        return lowered

    def cap(self, node_id: str, device: str, now: float | None = None) -> int | None:
        """The most a plan may give ``device`` of ``node_id`` now; None: no lowered budget."""
        if not self._lowered:
            return None
        lowered = self._lowered.get((node_id, device))
        if lowered is None:
            return None
        if (self.clock() if now is None else now) >= lowered.until:
            del self._lowered[(node_id, device)]
            self.version += 1
            return None
        return lowered.budget_bytes

    def active(self) -> list[LoweredBudget]:
        """The budgets in force now (expired ones dropped), for the admin API."""
        now = self.clock()
        for key, lowered in list(self._lowered.items()):
            if now >= lowered.until:
                del self._lowered[key]
                self.version += 1
        return sorted(self._lowered.values(), key=lambda b: (b.node_id, b.device))
