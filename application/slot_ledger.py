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
from domain.runtimes import runtime_capacity
from domain.set_index import discard
from domain.states import NodeState


class SlotLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # job → nodes it was dispatched to here
        self._runtime: dict[str, dict[str, Any] | None] = {}  # job → the server it runs on
        self._seen: set[tuple[str, str]] = set()  # (job, node) the read model has listed
        self._released: dict[str, set[str]] = {}  # job → nodes whose row may still list it
        # node → jobs in _held / _released naming it (adjust() costs O(jobs on the node))
        self._held_at: dict[str, set[str]] = {}
        self._released_at: dict[str, set[str]] = {}

    def assigned(
        self, job_id: str, node_ids: Iterable[str], runtime: dict[str, Any] | None = None
    ) -> None:
        with self._lock:
            nodes = set(node_ids)
            left = self._held.get(job_id, set()) - nodes
            self._drop_release(job_id)
            for node in left:  # a re-plan moved the job: its old nodes count as released
                discard(self._held_at, node, job_id)
                self._seen.discard((job_id, node))
                self._released.setdefault(job_id, set()).add(node)
                self._released_at.setdefault(node, set()).add(job_id)
            self._held[job_id] = nodes
            self._runtime[job_id] = runtime
            for node in nodes:
                self._held_at.setdefault(node, set()).add(job_id)

    def released(self, job_id: str) -> None:
        with self._lock:
            nodes = self._held.pop(job_id, None)
            self._runtime.pop(job_id, None)
            if nodes:
                self._released[job_id] = nodes
                for node in nodes:
                    discard(self._held_at, node, job_id)
                    self._released_at.setdefault(node, set()).add(job_id)
                    self._seen.discard((job_id, node))

    def _drop_release(self, job_id: str) -> None:
        for node in self._released.pop(job_id, ()):
            discard(self._released_at, node, job_id)

    def _forget_hold(self, job_id: str, node_id: str) -> None:
        self._seen.discard((job_id, node_id))
        discard(self._held_at, node_id, job_id)
        discard(self._held, job_id, node_id)
        if job_id not in self._held:
            self._runtime.pop(job_id, None)

    def adjust_all(self, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Rows by node id, each adjusted: only rows of nodes the ledger names cost work."""
        with self._lock:
            touched = self._held_at.keys() | self._released_at.keys()
        return {
            row["node_id"]: self.adjust(row) if row["node_id"] in touched else row for row in rows
        }

    def adjust(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (a ``nodes`` view row) with this controller's own assignments applied."""
        node_id = row["node_id"]
        with self._lock:
            held_here = self._held_at.get(node_id)
            released_here = self._released_at.get(node_id)
            if not held_here and not released_here:
                return row
            listed = set(row["current_jobs"])
            held: set[str] = set()
            runtime = row.get("runtime")
            for job in list(held_here or ()):
                if job in listed:
                    self._seen.add((job, node_id))
                    held.add(job)
                elif (job, node_id) in self._seen:
                    # Listed before and gone now: released by a path this process did not
                    # take part in (e.g. the node went offline); forget it here too.
                    self._forget_hold(job, node_id)
                else:
                    held.add(job)  # not projected yet
                    runtime = self._runtime.get(job, runtime)
            released = set()
            for job in list(released_here or ()):
                if job in listed:
                    released.add(job)
                else:  # the read model has caught up with this release
                    discard(self._released_at, node_id, job)
                    discard(self._released, job, node_id)
        jobs = (listed - released) | held
        if jobs == listed and runtime is row.get("runtime"):
            return row
        adjusted = {**row, "current_jobs": sorted(jobs), "runtime": runtime}
        if row["state"] in (NodeState.READY, NodeState.BUSY):
            capacity = runtime_capacity(runtime, int(row["slots"]))
            adjusted["state"] = settled_state(len(jobs), capacity, False).value
        return adjusted

    def __len__(self) -> int:
        with self._lock:
            return len(self._held) + len(self._released)
