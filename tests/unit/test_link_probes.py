"""application/link_probes.py: who measures its links and when (the clock is the sweep's
argument: no sleeps), which reports are believed, and what the read model and the scheduler
make of them; on an in-memory store with a fake agent gateway."""

from __future__ import annotations

import math

import pytest

from application.controller import Controller
from application.link_probes import PROBE_TIMEOUT, RETRY_SECONDS, LinkMeasure, LinkProbes
from application.scheduler import links_of
from common.contract import TRANSFER_PORT_LABEL
from common.link_probe import PROBE_SUBJECT
from domain.placement import Link
from infrastructure.settings import Settings, SettingsError
from tests.enrollments import ready_node
from tests.unit.fakes import FakeAgentGateway, FakeReadModel

INTERVAL = 600.0


class Nodes:
    """Three nodes that serve model files, connected, and the link probes over them."""

    def __init__(self, count: int = 3) -> None:
        self.app = Controller()
        self.read = FakeReadModel(self.app)
        self.gateway = FakeAgentGateway()
        self.ids = [
            ready_node(
                self.app,
                f"n{i}",
                address=f"10.0.0.{i + 1}",
                labels={TRANSFER_PORT_LABEL: str(50070 + i)},
            )
            for i in range(count)
        ]
        self.tickets: list[tuple[str, str]] = []
        self.probes = LinkProbes(
            self.app, self.read, self.gateway, self.sign, interval=INTERVAL, probe_bytes=1 << 20
        )

    def sign(self, subject: str, node_id: str) -> str:
        self.tickets.append((subject, node_id))
        return f"ticket-{node_id}"

    def asked(self) -> list[str]:
        return [node for node, _ in self.gateway.link_probes]

    def request(self, node_id: str) -> tuple[str, list[str]]:
        request = next(r for n, r in reversed(self.gateway.link_probes) if n == node_id)
        return request.probe_id, [p.node_id for p in request.peers]


def test_each_node_is_asked_about_every_other_with_a_probe_ticket() -> None:
    nodes = Nodes()
    assert nodes.probes.sweep(0.0) == nodes.ids[:1]  # one node probes at a time
    node, request = nodes.gateway.link_probes[0]
    assert node == nodes.ids[0] and request.probe_bytes == 1 << 20
    assert [(p.node_id, p.host, p.port) for p in request.peers] == [
        (nodes.ids[1], "10.0.0.2", 50071),
        (nodes.ids[2], "10.0.0.3", 50072),
    ]
    assert {p.ticket for p in request.peers} == {f"ticket-{nodes.ids[0]}"}
    assert nodes.tickets[0] == (PROBE_SUBJECT, nodes.ids[0])


async def answer(nodes: Nodes, node: str, mbps: float = 940.0) -> None:
    probe_id, peers = nodes.request(node)
    measures = [LinkMeasure(peer, 0.25, mbps) for peer in peers]
    assert await nodes.probes.reported(node, probe_id, measures) is None


async def probe_round(nodes: Nodes, now: float) -> list[str]:
    """Sweeps at ``now`` until nobody is due, each node answering at once; the order asked."""
    order = []
    while asked := nodes.probes.sweep(now):
        order += asked
        await answer(nodes, asked[0])
    return order


async def test_one_node_probes_at_a_time_and_probes_repeat_at_the_interval() -> None:
    """Two downloads from one peer at once would each see half its link: the next node is
    asked once the last one answered, or after PROBE_TIMEOUT."""
    nodes = Nodes()
    assert nodes.probes.sweep(0.0) == nodes.ids[:1]
    assert nodes.probes.sweep(1.0) == []  # n0 has not answered yet
    assert nodes.probes.sweep(PROBE_TIMEOUT) == nodes.ids[1:2]  # n0 never will
    await answer(nodes, nodes.ids[1])
    # then the one never asked, then n0 again (asked longest ago, still lacking its links)
    assert await probe_round(nodes, PROBE_TIMEOUT) == [nodes.ids[2], nodes.ids[0]]
    assert await probe_round(nodes, PROBE_TIMEOUT + RETRY_SECONDS) == []
    row = nodes.read.get_node(nodes.ids[0])
    assert row is not None and set(row["links"]) == set(nodes.ids[1:])
    assert row["links"][nodes.ids[1]]["mbps"] == 940.0 and row["links"][nodes.ids[1]]["measured_at"]
    assert links_of(row) == {peer: Link(940.0, 0.25) for peer in nodes.ids[1:]}
    assert await probe_round(nodes, INTERVAL - 1) == []  # every link known: not before the interval
    assert await probe_round(nodes, INTERVAL + PROBE_TIMEOUT) == nodes.ids


async def test_a_node_that_joins_is_measured_soon_by_everyone() -> None:
    nodes = Nodes(2)
    assert await probe_round(nodes, 0.0) == nodes.ids
    late = ready_node(nodes.app, "late", address="10.0.0.9", labels={TRANSFER_PORT_LABEL: "1"})
    assert await probe_round(nodes, 1.0) == [late]  # it was never asked
    assert await probe_round(nodes, RETRY_SECONDS) == nodes.ids  # they lack a measure of it
    assert await probe_round(nodes, 2 * RETRY_SECONDS) == []  # everyone knows everyone


async def test_a_report_is_believed_only_as_asked_and_only_once() -> None:
    nodes = Nodes()
    nodes.probes.sweep(0.0)
    node = nodes.ids[0]
    probe_id, peers = nodes.request(node)
    refused = await nodes.probes.reported(node, "not-sent", [])
    assert refused is not None and "did not send" in refused
    stranger = await nodes.probes.reported(node, probe_id, [LinkMeasure("elsewhere", 1, 1)])
    assert stranger is not None and "not asked about" in stranger
    for bad in (math.nan, math.inf, -1.0, 2e6):
        refused = await nodes.probes.reported(node, probe_id, [LinkMeasure(peers[0], 1.0, bad)])
        assert refused is not None and "impossible" in refused
    failed = LinkMeasure(peers[1], 0.0, 0.0, "connect to 10.0.0.3:50072 refused")
    ok = [LinkMeasure(peers[0], 0.4, 800.0), failed]
    assert await nodes.probes.reported(node, probe_id, ok) is None
    again = await nodes.probes.reported(node, probe_id, ok)
    assert again is not None and "did not send" in again
    row = nodes.read.get_node(node)
    assert row is not None and row["links"][peers[1]]["error"].startswith("connect to")
    assert links_of(row) == {peers[0]: Link(800.0, 0.4)}  # a failed link is no link


async def test_nodes_not_connected_here_or_without_a_file_server_are_left_out() -> None:
    nodes = Nodes()
    nodes.gateway.disconnected.add(nodes.ids[2])
    plain = ready_node(nodes.app, "plain", address="10.0.0.8")  # serves no model files
    assert await probe_round(nodes, 0.0) == nodes.ids[:2]
    assert nodes.request(nodes.ids[0])[1] == [nodes.ids[1]]
    assert plain not in nodes.request(nodes.ids[1])[1]
    no_tls = LinkProbes(nodes.app, nodes.read, nodes.gateway, None)
    assert no_tls.sweep(0.0) == []  # no tickets, no probes


def test_the_settings() -> None:
    settings = Settings.from_env({})
    assert (settings.link_probe_interval, settings.min_split_link_mbps) == (600.0, 50.0)
    assert Settings.from_env({"MIN_SPLIT_LINK_MBPS": "0"}).min_split_link_mbps == 0.0
    for bad in ("-1", "fast", "inf"):
        with pytest.raises(SettingsError, match="MIN_SPLIT_LINK_MBPS"):
            Settings.from_env({"MIN_SPLIT_LINK_MBPS": bad})
    with pytest.raises(SettingsError, match="LINK_PROBE_INTERVAL"):
        Settings.from_env({"LINK_PROBE_INTERVAL": "0"})
