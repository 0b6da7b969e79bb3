"""Steering a node: drain it, resume it, revoke it. Each use case records its event through the
``Controller`` first, then tells the nodes through the :class:`application.ports.AgentGateway`.

The methods block on the store: callers on the event loop run them in a thread (the gateway
may be called from any thread)."""

from __future__ import annotations

from uuid import UUID

from application.controller import Controller
from application.ports import AgentGateway


class NodeSteering:
    """Drain, resume and revocation of a node (the admin API's node commands)."""

    def __init__(self, app: Controller, gateway: AgentGateway) -> None:
        self.app = app
        self.gateway = gateway

    def drain(self, node_id: str, requested_by: str) -> int:
        """NODE_DRAIN_REQUESTED (and NODE_DRAINED at once when the node holds no job), then
        the node is told to take no new work; returns the store position to wait for."""
        position = self.app.request_drain(node_id, requested_by)
        self.gateway.drain(node_id)
        return position

    def resume(self, node_id: str, requested_by: str) -> int:
        """NODE_RESUMED, then the node is told it takes work again; returns the position."""
        position = self.app.resume(node_id, requested_by)
        self.gateway.resume(node_id)
        return position

    def revoke(self, node_id: UUID | str, reason: str, revoked_by: str) -> int:
        """NODE_REVOKED (its executing jobs fail with it); returns the position. The nodes are
        told by :meth:`revoked` once the event is seen, whoever recorded it (this controller,
        another one, ``dacp nodes revoke``)."""
        return self.app.revoke_node(node_id, reason, revoked_by)

    def revoked(self, node_id: str) -> bool:
        """Tells the nodes that ``node_id`` was revoked: its stream here ends, every other
        node refuses it from now on. True when it had a stream here."""
        return self.gateway.revoke(node_id)
