"""The health monitor: turns late or missing heartbeats into recorded state changes.

Heartbeats only update live state. A periodic sweep compares each node's last-seen time
with ``DEGRADED_AFTER`` and ``OFFLINE_AFTER`` and records ``HEARTBEAT_TIMEOUT``,
``NODE_OFFLINE`` or ``NODE_RECOVERED``. Decisions are a pure function of (read-model row,
live entry, now), so several controllers sweeping at once agree; the aggregate's guards
turn a duplicate decision into a refused command, never into a second event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from application.controller import Controller
from application.errors import NotFound
from application.ports import LiveNode, LiveState, ReadModel
from domain.errors import DomainError
from domain.states import NodeState

log = logging.getLogger(__name__)

Action = Literal["timeout", "offline", "recover"]

_IN_SERVICE = {NodeState.READY, NodeState.BUSY, NodeState.DRAINING}


@dataclass(frozen=True)
class HealthThresholds:
    degraded_after: float
    offline_after: float


def decide(
    row: dict[str, Any], live: LiveNode | None, now: float, since: float, limits: HealthThresholds
) -> tuple[Action, float] | None:
    """What the sweep should record for one node, with the heartbeat age it saw.

    ``since`` stands in for the last heartbeat of a node this controller has never heard
    from (it just started): such a node gets the full thresholds to reconnect.
    """
    state = row["state"]
    last_seen = live.last_seen if live is not None else since
    age = max(0.0, now - last_seen)
    connected = live is not None and live.connected
    if state in _IN_SERVICE:
        if age > limits.offline_after:
            return "offline", age
        if age > limits.degraded_after:
            return "timeout", age
    elif state == NodeState.DEGRADED:
        if age > limits.offline_after:
            return "offline", age
        if connected and age <= limits.degraded_after:
            return "recover", age
    elif state == NodeState.REGISTERING:
        if age > limits.offline_after and not connected:
            return "offline", age
    elif state in (NodeState.OFFLINE, NodeState.ERROR):
        if connected and age <= limits.degraded_after and state == NodeState.OFFLINE:
            return "recover", age
    return None


@dataclass(frozen=True, slots=True)
class HealthMonitor:
    app: Controller
    read_model: ReadModel
    live: LiveState
    limits: HealthThresholds
    #: When this controller started: the last heartbeat of a node it never heard from.
    started_at: float

    def sweep(self, now: float) -> list[tuple[str, Action]]:
        """Records what the heartbeats call for; returns the actions taken."""
        live = self.live.all()
        taken: list[tuple[str, Action]] = []
        for row in self.read_model.list_nodes():
            node_id = row["node_id"]
            decision = decide(row, live.get(node_id), now, self.started_at, self.limits)
            if decision is None:
                continue
            action, age = decision
            try:
                if action == "timeout":
                    self.app.heartbeat_timeout(node_id, round(age, 3))
                elif action == "offline":
                    self.app.mark_offline(node_id, f"no heartbeat for {age:.1f} s")
                else:
                    self.app.mark_recovered(node_id)
            except (DomainError, NotFound) as e:
                # Another controller (or the stream handler) got there first.
                log.debug("health sweep skipped %s on %s: %s", action, node_id, e)
                continue
            taken.append((node_id, action))
        return taken
