"""What this controller knows about node slots before its read model does.

The read model follows the event store asynchronously, and under load it lags by tens of
milliseconds. Waiting for it before every placement (read-your-writes) made placement the
bottleneck, so the scheduler instead overlays this ledger on the rows it reads: jobs this
process has dispatched count against their nodes at once, and jobs it has released stop
counting at once. Entries are dropped as soon as the read model shows the same thing.

Writes by other controllers still reach this one only through the read model; a slot taken
meanwhile is caught by the event store's version check (``SlotTaken``), never double-booked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from domain.node import settled_state
from domain.states import NodeState


class SlotLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # job → nodes it was dispatched to here
        self._seen: set[tuple[str, str]] = set()  # (job, node) the read model has listed
        self._released: dict[str, set[str]] = {}  # job → nodes whose row may still list it

    def assigned(self, job_id: str, node_ids: Iterable[str]) -> None:
        with self._lock:
            self._held[job_id] = set(node_ids)
            self._released.pop(job_id, None)

    def released(self, job_id: str) -> None:
        with self._lock:
            nodes = self._held.pop(job_id, None)
            if nodes:
                self._released[job_id] = nodes
                self._seen -= {(job_id, node) for node in nodes}

    def adjust(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (a ``nodes`` view row) with this controller's own assignments applied."""
        node_id = row["node_id"]
        listed = set(row["current_jobs"])
        with self._lock:
            held = set()
            for job, nodes in list(self._held.items()):
                if node_id not in nodes:
                    continue
                if job in listed:
                    self._seen.add((job, node_id))
                    held.add(job)
                elif (job, node_id) in self._seen:
                    # Listed before and gone now: released by a path this process did not
                    # take part in (e.g. the node went offline); forget it here too.
                    self._seen.discard((job, node_id))
                    nodes.discard(node_id)
                    if not nodes:
                        del self._held[job]
                else:
                    held.add(job)  # not projected yet
            released = set()
            for job, nodes in list(self._released.items()):
                if node_id not in nodes:
                    continue
                if job in listed:
                    released.add(job)
                else:  # the read model has caught up with this release
                    nodes.discard(node_id)
                    if not nodes:
                        del self._released[job]
        jobs = (listed - released) | held
        if jobs == listed:
            return row
        adjusted = {**row, "current_jobs": sorted(jobs)}
        if row["state"] in (NodeState.READY, NodeState.BUSY):
            adjusted["state"] = settled_state(len(jobs), int(row["slots"]), False).value
        return adjusted

    def __len__(self) -> int:
        with self._lock:
            return len(self._held) + len(self._released)
