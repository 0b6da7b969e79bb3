"""The cluster's recent history for the dashboard's charts: an in-memory ring buffer of
samples taken every few seconds (:data:`HISTORY_POINTS` of them: an hour at the default
:data:`DEFAULT_HISTORY_INTERVAL`).

Each :class:`Sample` holds, for the interval it closes:

* tokens generated per second, from the recorded ``TOKEN_STREAM_CHUNK`` events (what
  ``dacp_tokens_generated`` counts: every controller's jobs, through the projection follower);
* the time to first token's p50 and p95 over the requests whose first token was relayed in
  that interval (this controller's relays: what ``dacp_time_to_first_token_seconds``
  observes; None when none was);
* the admission queue's depth at that moment;
* per node: its busy slots and slots, CPU use, and each device's total and free memory (its
  latest heartbeat).

Nothing is stored: a restarted controller starts an empty history. The clock is injected,
and :meth:`MetricsHistory.sample` takes one sample when called, so that tests need no waits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from domain.catalog import code_of

log = logging.getLogger(__name__)

#: Seconds between samples unless METRICS_HISTORY_INTERVAL says otherwise.
DEFAULT_HISTORY_INTERVAL = 10.0
#: Samples kept: 360 samples of 10 s are the last hour.
HISTORY_POINTS = 360


@dataclass(frozen=True)
class DevicePoint:
    """One device of a node's llama.cpp build (a GPU, or the host CPU) and its memory."""

    name: str
    memory_total_bytes: int
    memory_free_bytes: int


@dataclass(frozen=True)
class NodePoint:
    """What one node was doing when the sample was taken."""

    node_id: str
    name: str
    busy_slots: int
    slots: int
    #: Whole-machine CPU use from its latest heartbeat (None: no heartbeat yet).
    cpu_percent: float | None = None
    devices: tuple[DevicePoint, ...] = ()


@dataclass(frozen=True)
class Sample:
    """The cluster over the interval that ends at ``time`` (unix seconds)."""

    time: float
    tokens_per_second: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    queue_depth: int
    nodes: tuple[NodePoint, ...] = ()


@dataclass(frozen=True)
class HistorySources:
    """Where the gauges come from, read once per sample (callables: nothing held here)."""

    queue_depth: Callable[[], int]
    nodes: Callable[[], Sequence[NodePoint]] = tuple
    #: Unix time now.
    clock: Callable[[], float] = field(default=time.time)


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The nearest-rank percentile of ``values`` (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class MetricsHistory:
    """The ring buffer, and what fills it between samples (thread-safe: tokens are counted
    on the follower's thread, first tokens on the event loop, samples in a worker thread)."""

    def __init__(
        self,
        sources: HistorySources,
        *,
        interval: float = DEFAULT_HISTORY_INTERVAL,
        points: int = HISTORY_POINTS,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"the sample interval must be positive, got {interval}")
        if points < 1:
            raise ValueError(f"at least one point must be kept, got {points}")
        self.sources = sources
        self.interval = interval
        self.points = points
        self._samples: deque[Sample] = deque(maxlen=points)
        self._lock = threading.Lock()
        self._tokens = 0
        self._first_tokens: list[float] = []
        self._since = 0
        self._last = sources.clock()

    # ------------------------------------------------------------- what comes in

    def count_after(self, position: int) -> None:
        """Ignores events at or before ``position`` (history the follower catches up on)."""
        self._since = position

    def on_event(self, position: int, event: object) -> None:
        """The follower's listener: counts the tokens of each recorded chunk."""
        if position <= self._since or code_of(event) != "TOKEN_STREAM_CHUNK":
            return
        tokens = max(0, int(getattr(event, "token_count", 0) or 0))
        with self._lock:
            self._tokens += tokens

    def observe_time_to_first_token(self, seconds: float) -> None:
        with self._lock:
            self._first_tokens.append(max(0.0, seconds))

    # ------------------------------------------------------------------- samples

    def sample(self) -> Sample:
        """Closes the interval now: one sample, appended (the oldest goes when full)."""
        now = self.sources.clock()
        depth = self.sources.queue_depth()
        try:
            nodes = tuple(self.sources.nodes())
        except Exception:
            log.warning("metrics history: cannot read the nodes", exc_info=True)
            nodes = ()
        with self._lock:
            tokens, self._tokens = self._tokens, 0
            first, self._first_tokens = self._first_tokens, []
            elapsed, self._last = now - self._last, now
            p50, p95 = percentile(first, 50), percentile(first, 95)
            taken = Sample(
                time=now,
                tokens_per_second=round(tokens / elapsed, 3) if elapsed > 0 else 0.0,
                ttft_p50_ms=None if p50 is None else round(p50 * 1000, 3),
                ttft_p95_ms=None if p95 is None else round(p95 * 1000, 3),
                queue_depth=depth,
                nodes=nodes,
            )
            self._samples.append(taken)
        return taken

    def samples(self, since: float | None = None) -> list[Sample]:
        """The samples kept, oldest first; only those after ``since`` when given."""
        with self._lock:
            kept = list(self._samples)
        return kept if since is None else [s for s in kept if s.time > since]

    async def run(self) -> None:
        """Samples every ``interval`` seconds until cancelled (a failed sample is logged)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.to_thread(self.sample)
            except Exception:
                log.exception("metrics history: sampling failed")
