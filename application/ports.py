"""Ports the application needs from the outside world; adapters live in ``infrastructure``
and ``interfaces``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class LiveNode:
    """What the latest heartbeat said about a node. Not an event: it changes constantly."""

    node_id: str
    last_seen: float  # unix time of the last heartbeat the controller received
    telemetry: dict[str, Any] = field(default_factory=dict)
    connected: bool = True


class LiveState(Protocol):
    """Last-seen times and telemetry per node (Redis when configured, else in process)."""

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None: ...

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None: ...

    def get(self, node_id: str) -> LiveNode | None: ...

    def all(self) -> dict[str, LiveNode]: ...

    def ping(self) -> bool: ...


class AgentGateway(Protocol):
    """Sends control messages down to connected agents."""

    def send(self, node_id: str, message: Any) -> bool:
        """Queues ``message`` for the node; False when the node has no open stream."""
        ...

    def is_connected(self, node_id: str) -> bool: ...
