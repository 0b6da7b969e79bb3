"""Model files reach the nodes that need them: the controller asks a node to fetch a model
from nodes that hold it (``FetchModel``), with a ticket for each source, and records what the
node reports (``MODEL_TRANSFER_STARTED``, ``_PROGRESS`` at each quarter, ``_COMPLETED``,
``_FAILED``).

Sources are the nodes in service that report the file and serve model files (the
``dacp.transfer_port`` label), those sending the fewest files right now first: several nodes
needing the same model do not all pull from one source when a peer that just finished can
serve too. A transfer is the node's own activity; it outlives the request that caused it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from application.commands import FetchRequest, TransferReport, TransferSource
from application.controller import Controller
from application.errors import NotFound
from application.ports import AgentGateway
from application.read_models import ReadModel
from domain.errors import DomainError
from domain.states import NodeState
from proto import TRANSFER_PORT_LABEL

log = logging.getLogger(__name__)

#: Signs a ticket for (model sha256, fetching node id).
TicketSigner = Callable[[str, str], str]
_SERVING = {NodeState.READY.value, NodeState.BUSY.value, NodeState.DEGRADED.value}


class TransferRefused(Exception):
    """A pull that cannot start; the message says why."""


@dataclass(frozen=True)
class Pull:
    node_id: str
    transfer_id: str
    sources: tuple[str, ...]


def _size_of(node: dict[str, Any], sha256: str) -> int:
    for model in node.get("local_models") or ():
        if model.get("sha256") == sha256:
            return int(model.get("size_bytes") or 0)
    return 0


class TransferCoordinator:
    def __init__(
        self,
        app: Controller,
        nodes: ReadModel,
        gateway: AgentGateway,
        signer: TicketSigner | None,
        on_model_added: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.nodes = nodes
        self.gateway = gateway
        self.signer = signer
        self.on_model_added = on_model_added
        #: Transfers asked for and not ended, by id: (fetching node, request).
        self.running: dict[str, tuple[str, FetchRequest]] = {}
        #: Files each source node is sending now.
        self.uploads: Counter[str] = Counter()

    def holders(self, sha256: str) -> list[dict[str, Any]]:
        """Nodes in service that hold the model and serve model files."""
        return [
            n
            for n in self.nodes.list_nodes()
            if n["state"] in _SERVING
            and _size_of(n, sha256)
            and (n.get("labels") or {}).get(TRANSFER_PORT_LABEL)
        ]

    def pull(self, model: dict[str, Any], node_ids: list[str]) -> list[Pull]:
        """Asks each node to fetch ``model`` (nodes that hold it already are left alone)."""
        if self.signer is None:
            raise TransferRefused(
                "this controller cannot sign transfer tickets (its TLS files are the "
                "operator's, or it runs without TLS)"
            )
        sha256 = model["sha256"]
        holders = self.holders(sha256)
        if not holders:
            raise TransferRefused(f"no node in service holds model {model['name']} to fetch from")
        size = _size_of(holders[0], sha256)
        pulls = []
        for node_id in node_ids:
            if any(h["node_id"] == node_id for h in holders):
                continue
            if any(r[0] == node_id and r[1].sha256 == sha256 for r in self.running.values()):
                continue  # being fetched already
            if not self.gateway.is_connected(node_id):
                raise TransferRefused(f"node {node_id} is not connected to this controller")
            pulls.append(self._ask(node_id, model, holders, size))
        return pulls

    def _ask(
        self, node_id: str, model: dict[str, Any], holders: list[dict[str, Any]], size: int
    ) -> Pull:
        assert self.signer is not None
        ordered = sorted(holders, key=lambda h: (self.uploads[h["node_id"]], h["node_id"]))
        sources = tuple(
            TransferSource(
                h["node_id"],
                h["address"],
                int(h["labels"][TRANSFER_PORT_LABEL]),
                self.signer(model["sha256"], node_id),
            )
            for h in ordered
        )
        request = FetchRequest(
            str(uuid.uuid4()), model["sha256"], model["file_name"], size, sources
        )
        self.running[request.transfer_id] = (node_id, request)
        self.uploads[sources[0].node_id] += 1
        if not self.gateway.fetch_model(node_id, request):
            self._ended(request.transfer_id)
            raise TransferRefused(f"node {node_id} is not connected to this controller")
        log.info("node %s fetches %s from %s", node_id, model["file_name"], sources[0].node_id)
        return Pull(node_id, request.transfer_id, tuple(s.node_id for s in sources))

    def _ended(self, transfer_id: str) -> tuple[str, FetchRequest] | None:
        ended = self.running.pop(transfer_id, None)
        if ended is not None:
            first = ended[1].sources[0].node_id
            self.uploads[first] = max(0, self.uploads[first] - 1)
        return ended

    async def reported(self, node_id: str, report: TransferReport) -> None:
        """Records what a node said about one of its transfers."""
        running = self.running.get(report.transfer_id)
        try:
            if report.state == "started":
                if running is None or running[0] != node_id:
                    return  # not one this controller asked for
                await asyncio.to_thread(self.app.transfer_started, node_id, running[1])
                return
            if report.state in ("completed", "failed"):
                self._ended(report.transfer_id)
            await asyncio.to_thread(self.app.transfer_reported, node_id, report)
        except (DomainError, NotFound) as e:
            log.info("transfer %s on node %s: %s", report.transfer_id, node_id, e)
            return
        if report.state == "completed":
            self.on_model_added()
