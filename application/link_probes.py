"""Measuring the links between nodes, for the split planner.

A split over llama.cpp RPC sends the weights to its workers at setup and every token's
activations through them after, so the link between a primary and its workers decides how fast
it loads and decodes. The controller asks each agent to measure its links to its peers
(``ProbeLinks``, see :mod:`common.link_probe`: the least TCP connect time to the peer's model
file server, and the rate of a download from it) and records what comes back on the prober's
node (``NODE_LINKS_MEASURED``); the scheduler gives the planner those links, and the planner
takes split partners over the fastest ones and refuses a split over a link slower than
``MIN_SPLIT_LINK_MBPS`` (:mod:`domain.split_planner`).

:meth:`LinkProbes.sweep` decides who probes, from the clock it is given and the node rows: a
node in service probes every ``LINK_PROBE_INTERVAL``, and sooner (at most every
:data:`RETRY_SECONDS`) while it has no measure of a peer in service, so a node that joins is
measured soon, by it and by the others. One node probes at a time (the next is asked once
its report is in, or :data:`PROBE_TIMEOUT` has passed): two downloads from one peer at once
would each see half its link. A report is believed only for a probe this controller sent that
node, and only for the peers it was asked about, with figures a link can have.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from application.controller import Controller
from application.errors import NotFound
from application.ports import AgentGateway, LinkPeer, LinkProbeRequest, ReadModel, TicketSigner
from common.contract import TRANSFER_PORT_LABEL
from common.link_probe import DEFAULT_PROBE_BYTES, PROBE_SUBJECT
from domain.errors import DomainError
from domain.states import NodeState

log = logging.getLogger(__name__)

#: How often each node measures its links again (``LINK_PROBE_INTERVAL``).
DEFAULT_LINK_PROBE_INTERVAL = 600.0
#: How soon a node that lacks a measure of a peer in service probes again.
RETRY_SECONDS = 30.0
#: How long a probe may go unanswered before the next node is asked anyway.
PROBE_TIMEOUT = 60.0
#: The most a link may claim: a report beyond it is refused, not believed.
MAX_MBPS = 1_000_000.0
MAX_RTT_MS = 60_000.0
#: Nodes in these states probe and are probed (a draining node still serves files).
_IN_SERVICE = frozenset(
    {
        NodeState.READY.value,
        NodeState.BUSY.value,
        NodeState.DEGRADED.value,
        NodeState.DRAINING.value,
    }
)


@dataclass(frozen=True, slots=True)
class LinkMeasure:
    """One link as an agent measured it (``LinkMeasure``): to ``node_id``."""

    node_id: str
    rtt_ms: float
    mbps: float
    error: str = ""


class LinkProbes:
    def __init__(
        self,
        app: Controller,
        nodes: ReadModel,
        gateway: AgentGateway,
        signer: TicketSigner | None,
        interval: float = DEFAULT_LINK_PROBE_INTERVAL,
        probe_bytes: int = DEFAULT_PROBE_BYTES,
    ) -> None:
        if interval <= 0:
            raise ValueError("LINK_PROBE_INTERVAL must be positive")
        self.app = app
        self.nodes = nodes
        self.gateway = gateway
        self.signer = signer
        self.interval = interval
        self.probe_bytes = probe_bytes
        #: node → (when it was last asked, the probe id, the peers asked about).
        self._asked: dict[str, tuple[float, str, frozenset[str]]] = {}

    def _serving(self) -> list[dict[str, Any]]:
        """Nodes in service, connected here, with an address and a model file server."""
        return [
            row
            for row in self.nodes.list_nodes()
            if row["state"] in _IN_SERVICE
            and row.get("address")
            and (row.get("labels") or {}).get(TRANSFER_PORT_LABEL)
            and self.gateway.is_connected(row["node_id"])
        ]

    def due(self, row: dict[str, Any], peers: Sequence[str], now: float) -> bool:
        """Whether ``row``'s node should measure its links to ``peers`` now."""
        asked = self._asked.get(row["node_id"])
        if asked is None:
            return True
        since = now - asked[0]
        measured = row.get("links") or {}
        missing = any(peer not in measured for peer in peers)
        return since >= self.interval or (missing and since >= RETRY_SECONDS)

    def sweep(self, now: float) -> list[str]:
        """Asks the first node that is due to measure its links, unless a probe is under way
        (see the module's docstring); returns the node asked, if any. Nothing without a
        ticket signer (no TLS): the file servers the probes use serve only with tickets."""
        if self.signer is None:
            return []
        if self._in_flight(now):
            return []
        serving = self._serving()
        asked: list[str] = []
        # The node asked longest ago first (never asked: first of all), so one that does not
        # answer holds nobody else's turn.
        for row in sorted(serving, key=lambda r: self._asked.get(r["node_id"], (-1.0,))[0]):
            node_id = row["node_id"]
            peers = [p for p in serving if p["node_id"] != node_id]
            if not peers or not self.due(row, [p["node_id"] for p in peers], now):
                continue
            ticket = self.signer(PROBE_SUBJECT, node_id)
            request = LinkProbeRequest(
                probe_id=uuid.uuid4().hex,
                peers=tuple(
                    LinkPeer(
                        p["node_id"],
                        str(p["address"]),
                        int(p["labels"][TRANSFER_PORT_LABEL]),
                        ticket,
                    )
                    for p in peers
                ),
                probe_bytes=self.probe_bytes,
            )
            if self.gateway.probe_links(node_id, request):
                peer_ids = frozenset(p.node_id for p in request.peers)
                self._asked[node_id] = (now, request.probe_id, peer_ids)
                asked.append(node_id)
                break  # one at a time
        return asked

    def _in_flight(self, now: float) -> bool:
        """Whether a node was asked less than :data:`PROBE_TIMEOUT` ago and has not answered."""
        return any(
            probe_id and now - at < PROBE_TIMEOUT for at, probe_id, _ in self._asked.values()
        )

    async def reported(
        self, node_id: str, probe_id: str, links: Sequence[LinkMeasure]
    ) -> str | None:
        """Records the links ``node_id`` measured; why the report is refused, or None."""
        asked = self._asked.get(node_id)
        if asked is None or asked[1] != probe_id:
            return f"a link report for probe {probe_id!r}, which this controller did not send"
        recorded: dict[str, dict[str, Any]] = {}
        for link in links:
            if link.node_id not in asked[2]:
                return f"a link report about node {link.node_id!r}, which it was not asked about"
            if not (
                math.isfinite(link.mbps)
                and math.isfinite(link.rtt_ms)
                and 0 <= link.mbps <= MAX_MBPS
                and 0 <= link.rtt_ms <= MAX_RTT_MS
            ):
                return f"a link report with impossible figures for node {link.node_id}"
            recorded[link.node_id] = {
                "rtt_ms": round(link.rtt_ms, 3),
                "mbps": round(link.mbps, 1),
                "error": link.error[:200],
            }
        self._asked[node_id] = (asked[0], "", asked[2])  # one report per probe
        try:
            await asyncio.to_thread(self.app.record_links, node_id, recorded)
        except (DomainError, NotFound) as e:
            log.info("links of node %s not recorded: %s", node_id, e)
        return None
