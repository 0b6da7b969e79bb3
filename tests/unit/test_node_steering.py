"""Drain, resume and revocation of a node as use cases (application/node_steering.py): each is
recorded through the Controller, then the nodes are told through the agent gateway; and the
protobuf each gateway call sends (interfaces/grpc/agent_bridge.py: ProtoAgentGateway)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from uuid import UUID

import pytest

from application.controller import Controller
from application.node_steering import NodeSteering
from domain.catalog import code_of
from domain.errors import DomainError
from interfaces.grpc.agent_bridge import ProtoAgentGateway
from interfaces.grpc.grpc_server import AgentConnections, Outbox
from tests.enrollments import ready_node
from tests.unit.fakes import FakeAgentGateway
from wire import control_pb2 as pb


@dataclass
class WitnessGateway(FakeAgentGateway):
    """Notes the node's newest recorded event each time the node is told something."""

    app: Controller = field(default_factory=Controller)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (call, newest event code)

    def _witness(self, call: str, node_id: str) -> None:
        self.seen.append((call, codes(self.app, node_id)[-1]))

    def drain(self, node_id: str) -> bool:
        self._witness("drain", node_id)
        return super().drain(node_id)

    def resume(self, node_id: str) -> bool:
        self._witness("resume", node_id)
        return super().resume(node_id)


def codes(app: Controller, node_id: str) -> list[str]:
    return [code_of(e) for e in app.events.get(UUID(node_id))]


def steering() -> tuple[NodeSteering, Controller, WitnessGateway]:
    app = Controller()
    gateway = WitnessGateway(app=app)
    return NodeSteering(app, gateway), app, gateway


def test_drain_is_recorded_before_the_node_is_told() -> None:
    steer, app, gateway = steering()
    node = ready_node(app)
    position = steer.drain(node, "admin-api")
    assert position == app.position()
    assert codes(app, node)[-2:] == ["NODE_DRAIN_REQUESTED", "NODE_DRAINED"]  # idle: at once
    assert gateway.drains == [node]
    assert gateway.seen == [("drain", "NODE_DRAINED")]
    assert gateway.resumes == [] and gateway.revocations == []


def test_resume_is_recorded_before_the_node_is_told() -> None:
    steer, app, gateway = steering()
    node = ready_node(app)
    steer.drain(node, "admin-api")
    position = steer.resume(node, "cli")
    assert position == app.position()
    assert codes(app, node)[-1] == "NODE_RESUMED"
    assert gateway.resumes == [node]
    assert gateway.seen[-1] == ("resume", "NODE_RESUMED")


def test_a_refused_command_tells_the_node_nothing() -> None:
    steer, app, gateway = steering()
    node = ready_node(app)
    with pytest.raises(DomainError):
        steer.resume(node, "admin-api")  # no drain was requested
    steer.drain(node, "admin-api")
    with pytest.raises(DomainError):
        steer.drain(node, "admin-api")  # already requested
    assert gateway.resumes == [] and gateway.drains == [node]
    assert codes(app, node).count("NODE_DRAIN_REQUESTED") == 1


def test_revoke_records_and_the_nodes_are_told_once_the_event_is_seen() -> None:
    steer, app, gateway = steering()
    node = ready_node(app)
    position = steer.revoke(node, "laptop stolen", "admin-api")
    assert position == app.position()
    assert codes(app, node)[-1] == "NODE_REVOKED"
    assert gateway.revocations == []  # told by whoever sees the event, not by the recorder
    assert steer.revoked(node) is True
    gateway.disconnected.add(node)
    assert steer.revoked(node) is False  # no stream here any more
    assert gateway.revocations == [node, node]
    with pytest.raises(DomainError):
        steer.revoke(node, "again", "admin-api")


async def _messages(outbox: Outbox) -> list[pb.ControllerMessage]:
    """What waits in ``outbox`` (its end-of-stream marker left out), taken from it."""
    items = []
    while outbox.qsize():
        item = await outbox.get()
        if isinstance(item, pb.ControllerMessage):
            items.append(item)
    return items


async def test_the_proto_gateway_sends_drain_resume_and_nodes_revoked() -> None:
    connections = AgentConnections()
    connections.bind(asyncio.get_running_loop())
    gateway = ProtoAgentGateway(connections)
    one, two = connections.open("n1"), connections.open("n2")
    assert gateway.drain("n1") and gateway.resume("n1")
    assert not gateway.drain("n3")  # no stream
    assert [m.WhichOneof("payload") for m in await _messages(one)] == ["drain", "resume"]
    assert await _messages(two) == []
    assert gateway.revoke("n1") is True
    assert one.closed and not two.closed
    assert await _messages(one) == []  # n1 hears nothing more: its stream ends
    told = pb.ControllerMessage(nodes_revoked=pb.NodesRevoked(node_ids=["n1"]))
    assert await _messages(two) == [told]
    assert gateway.revoke("n4") is False  # no stream of its own; the others are told
    assert await _messages(two) == [
        pb.ControllerMessage(nodes_revoked=pb.NodesRevoked(node_ids=["n4"]))
    ]
