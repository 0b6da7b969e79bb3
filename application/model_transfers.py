"""Model files reach the nodes that need them: the controller asks a node to fetch a model
(``FetchModel``), with a ticket for each source, and records what the node reports
(``MODEL_TRANSFER_STARTED``, ``_PROGRESS`` at each quarter, ``_COMPLETED``, ``_FAILED``).

Sources are the nodes in service that proved they hold the file (``MODEL_PROVEN``: a node's
report alone is not believed) and serve model files (the ``dacp.transfer_port`` label), and
the controller's own model store when it holds the file (``MODEL_STORED``), those sending the
fewest files right now first: several nodes needing the same model do not all pull from one
source when a peer that just finished can serve too. The model's http(s) URLs come last. The
file's size is the model's registered one, never a node's word. A transfer is the node's own
activity; it outlives the request that caused it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from application.commands import FetchRequest, TransferReport, TransferSource
from application.controller import Controller
from application.errors import NotFound
from application.ports import AgentGateway, ReadModel, TicketSigner
from application.read_models import model_facts, proven_holders
from common.contract import TRANSFER_PORT_LABEL
from common.transfer_ticket import CONTROLLER_SOURCE_ID
from domain.errors import DomainError
from domain.states import NodeState

log = logging.getLogger(__name__)

#: A plan for a model as if some nodes held its file: (model, those nodes) → the primary's
#: node id, or None when even that gives no plan (``replica_if_held``: no plan of one node).
PrimaryIfHeld = Callable[[dict[str, Any], frozenset[str]], str | None]
#: How long a finished fetch counts as under way, until the node reports the file.
REPORT_GRACE_SECONDS = 30.0
#: Nodes looked at, at most, for an on-demand fetch.
MAX_FETCH_TARGETS = 8
#: How long a node whose fetch of a model failed is not asked again on demand (an operator's
#: pull still asks it): the same failure would hold the next requests back as well.
FAILED_COOLDOWN_SECONDS = 60.0
#: Nodes in these states serve their files (a draining node takes no jobs, but serves files).
_SERVING = {
    NodeState.READY.value,
    NodeState.BUSY.value,
    NodeState.DEGRADED.value,
    NodeState.DRAINING.value,
}


class TransferRefused(Exception):
    """A pull that cannot start; the message says why."""


@dataclass(frozen=True)
class Pull:
    node_id: str
    transfer_id: str
    sources: tuple[str, ...]


def _size_of(node: dict[str, Any], sha256: str) -> int:
    """The size the node reports for the file (0: it does not report it). Its own word: only
    good to tell whether it says it holds the file, never how large the file is."""
    for model in node.get("local_models") or ():
        if model.get("sha256") == sha256:
            return int(model.get("size_bytes") or 0)
    return 0


def _room_of(node: dict[str, Any]) -> int | None:
    """What a new model file may take on the node (None: its agent does not say)."""
    room = (node.get("resources") or {}).get("models_free_bytes")
    return None if room is None else int(room)


def _fits(node: dict[str, Any], size: int) -> bool:
    room = _room_of(node)
    return not size or room is None or size <= room


class TransferCoordinator:
    def __init__(
        self,
        app: Controller,
        nodes: ReadModel,
        gateway: AgentGateway,
        signer: TicketSigner | None,
        on_model_added: Callable[[], None] = lambda: None,
        primary_if_held: PrimaryIfHeld | None = None,
        replica_if_held: PrimaryIfHeld | None = None,
        clock: Callable[[], float] = time.monotonic,
        store_port: int = 0,
        source_cidrs: tuple[str, ...] = (),
        proving: Callable[[dict[str, Any]], bool] = lambda _model: False,
    ) -> None:
        self.app = app
        #: Networks a URL source may be on although agents refuse them by default
        #: (``MODEL_SOURCE_ALLOWED_CIDRS``), sent with each fetch.
        self.source_cidrs = source_cidrs
        self.nodes = nodes
        self.gateway = gateway
        self.signer = signer
        self.on_model_added = on_model_added
        #: Transfers asked for and not ended, by id: (fetching node, request).
        self.running: dict[str, tuple[str, FetchRequest]] = {}
        #: Files each source node is sending now.
        self.uploads: Counter[str] = Counter()
        self.primary_if_held = primary_if_held
        #: As ``primary_if_held``, for a plan of that one node alone (no split).
        self.replica_if_held = replica_if_held
        self.clock = clock
        #: The port the controller's model store serves on (0: it serves no files).
        self.store_port = store_port
        #: (node, sha256) → when its fetch completed (the node's report may still be on its way).
        self.completed: dict[tuple[str, str], float] = {}
        #: (node, sha256) → when its fetch failed (see FAILED_COOLDOWN_SECONDS).
        self.failed: dict[tuple[str, str], float] = {}
        #: Evictions waiting for the node's answer: (node, sha256) → (ok, file name, error).
        self.evictions: dict[tuple[str, str], asyncio.Future[tuple[bool, str, str]]] = {}
        #: Whether a node that reports the model's file is proving it holds it now (the
        #: model-claims sweep): jobs wait for the proof as they wait for a fetch.
        self.proving = proving

    def _rows(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.nodes.list_nodes()}

    def _current(self, model: dict[str, Any]) -> dict[str, Any]:
        """``model`` with its facts as they are now (a request's row may predate them)."""
        now = self.nodes.get_model(model["name"])
        if now is None or now["sha256"] != model["sha256"]:
            return model
        return {**model, "shape": now.get("shape"), "shape_from": now.get("shape_from")}

    def holders(self, model: dict[str, Any]) -> list[dict[str, Any]]:
        """Nodes in service that proved they hold the model's file and serve model files."""
        return [
            n
            for n in proven_holders(self._current(model), self._rows(), frozenset(_SERVING))
            if (n.get("labels") or {}).get(TRANSFER_PORT_LABEL)
        ]

    def stores(self, model: dict[str, Any]) -> bool:
        """Whether the controller's model store holds the model and serves it."""
        return bool(self.store_port and model.get("stored") and self.signer is not None)

    def pull(self, model: dict[str, Any], node_ids: list[str]) -> list[Pull]:
        """Asks each node to fetch ``model`` (nodes that hold it already are left alone). Either
        every node named can be asked, or none is: :class:`TransferRefused` says why not."""
        sha256 = model["sha256"]
        holders = self.holders(model) if self.signer is not None else []
        if not holders and not self.stores(model) and not model.get("sources"):
            if self.signer is None:
                raise TransferRefused(
                    f"model {model['name']} has no http(s) source, and this controller cannot "
                    "sign the tickets a fetch from a node or its own store needs (its TLS "
                    "files are the operator's, or it runs without TLS)"
                )
            raise TransferRefused(
                f"no node in service holds model {model['name']} to fetch from, the "
                "controller's model store does not hold it, and it has no http(s) source"
            )
        size = self._size(model)
        rows = self._rows()
        wanted = []
        for node_id in dict.fromkeys(node_ids):
            if any(h["node_id"] == node_id for h in holders):
                continue
            if any(r[0] == node_id and r[1].sha256 == sha256 for r in self.running.values()):
                continue  # being fetched already
            if not self.gateway.is_connected(node_id):
                raise TransferRefused(f"node {node_id} is not connected to this controller")
            row = rows.get(node_id)
            if row is not None and not _fits(row, size):
                raise TransferRefused(
                    f"node {row['name']} has room for {_room_of(row)} bytes of model files (its "
                    f"disk, or --models-disk-limit); {model['file_name']} is {size} bytes: "
                    f"evict a model there first (dacp models evict MODEL --node {row['name']})"
                )
            wanted.append(node_id)
        return [self._ask(node_id, model, holders) for node_id in wanted]

    def fetch_for(self, model: dict[str, Any]) -> bool:
        """Whether a fetch of ``model`` is under way, or starts now, onto a node that could then
        run its jobs (as their primary): jobs that cannot start wait for it in the queue."""
        return self._fetch_onto_primary(model, self.primary_if_held)

    def fetch_replica(self, model: dict[str, Any]) -> bool:
        """Whether a fetch of ``model`` is under way, or starts now, onto a node that could
        then run its jobs alone: the next jobs get a replica there instead of a split (the
        split serves the job that asked meanwhile)."""
        return self._fetch_onto_primary(model, self.replica_if_held)

    def _fetch_onto_primary(self, model: dict[str, Any], primary_if: PrimaryIfHeld | None) -> bool:
        """A fetch under way, or started onto the first target ``primary_if`` names as the
        primary of a plan it would then have."""
        sha256 = model["sha256"]
        now = self.clock()
        # A fetch whose node went away reports nothing more: it no longer holds jobs back.
        for transfer_id, (node_id, _) in list(self.running.items()):
            if not self.gateway.is_connected(node_id):
                self._ended(transfer_id)
        self.completed = {k: t for k, t in self.completed.items() if now - t < REPORT_GRACE_SECONDS}
        if any(r[1].sha256 == sha256 for r in self.running.values()):
            return True
        if any(sha == sha256 for _, sha in self.completed):
            return True
        if self.proving(model):
            return True
        if self.signer is None or primary_if is None:
            return False
        holders = self.holders(model)
        if not holders and not self.stores(model):
            return False
        # A node that reports the file already is no target: it has it, or its claim failed.
        held = {n["node_id"] for n in self.nodes.list_nodes() if _size_of(n, sha256)}
        size = self._size(model)
        self.failed = {k: t for k, t in self.failed.items() if now - t < FAILED_COOLDOWN_SECONDS}
        targets = [
            n
            for n in self.nodes.list_nodes()
            if n["state"] == NodeState.READY.value
            and not n["current_jobs"]
            and not n.get("drain_requested")
            and n["node_id"] not in held
            and (n["node_id"], sha256) not in self.failed
            and _fits(n, size)
            and self.gateway.is_connected(n["node_id"])
        ]
        # The roomiest few: each look is a placement over every node.
        targets.sort(key=lambda n: -int((n.get("resources") or {}).get("ram_free_bytes") or 0))
        for target in targets[:MAX_FETCH_TARGETS]:
            node_id = target["node_id"]
            if primary_if(model, frozenset({node_id})) != node_id:
                continue
            try:
                self.pull(model, [node_id])
            except TransferRefused as e:
                log.info("cannot fetch %s onto node %s: %s", model["name"], node_id, e)
                continue
            log.info("jobs for %s wait while node %s fetches it", model["name"], node_id)
            return True
        return False

    async def evict(self, node_id: str, model: dict[str, Any], timeout: float = 30.0) -> str:
        """Has the node delete the model's file; returns the file's name. Raises
        :class:`TransferRefused` when it is in use or the node does not answer."""
        sha256 = model["sha256"]
        node = next((n for n in self.nodes.list_nodes() if n["node_id"] == node_id), None)
        if node is None or not _size_of(node, sha256):
            raise TransferRefused(f"node {node_id} does not hold model {model['name']}")
        if (
            node["current_jobs"]
            and (node.get("runtime") or {}).get("plan", {}).get("model_sha256") == sha256
        ):
            raise TransferRefused(f"jobs on node {node['name']} use model {model['name']} now")
        if any(r[0] == node_id and r[1].sha256 == sha256 for r in self.running.values()):
            raise TransferRefused(f"node {node['name']} is fetching model {model['name']}")
        answer: asyncio.Future[tuple[bool, str, str]] = asyncio.get_running_loop().create_future()
        self.evictions[(node_id, sha256)] = answer
        try:
            if not self.gateway.evict_model(node_id, sha256):
                raise TransferRefused(f"node {node['name']} is not connected to this controller")
            try:
                ok, file_name, error = await asyncio.wait_for(answer, timeout)
            except TimeoutError:
                raise TransferRefused(f"node {node['name']} did not answer") from None
        finally:
            self.evictions.pop((node_id, sha256), None)
        if not ok:
            raise TransferRefused(f"node {node['name']} keeps model {model['name']}: {error}")
        await asyncio.to_thread(self.app.model_evicted, node_id, sha256, file_name)
        return file_name

    async def evicted(
        self, node_id: str, sha256: str, ok: bool, file_name: str, error: str
    ) -> None:
        """A node's answer to an eviction."""
        waiting = self.evictions.get((node_id, sha256))
        if waiting is not None and not waiting.done():
            waiting.set_result((ok, file_name, error))

    def _sources(
        self, node_id: str, model: dict[str, Any], holders: list[dict[str, Any]]
    ) -> tuple[TransferSource, ...]:
        """Where ``node_id`` may fetch the model, in order: the peers and the controller's
        store sending the fewest files now first (peers before the store on a tie), then the
        model's URLs."""
        served: list[tuple[str, str, int]] = [
            (h["node_id"], h["address"], int(h["labels"][TRANSFER_PORT_LABEL])) for h in holders
        ]
        if self.stores(model):
            # The host is the agent's to fill in: the one it reaches this controller at.
            served.append((CONTROLLER_SOURCE_ID, "", self.store_port))
        served.sort(key=lambda s: (self.uploads[s[0]], s[0] == CONTROLLER_SOURCE_ID, s[0]))
        signer = self.signer
        ticket = signer(model["sha256"], node_id) if signer is not None and served else ""
        return tuple(TransferSource(n, host, port, ticket) for n, host, port in served) + tuple(
            TransferSource("", "", 0, "", url) for url in model.get("sources") or ()
        )

    def _size(self, model: dict[str, Any]) -> int:
        """The model file's size, from its registered facts (0: none known; a URL's answer
        will say). Never a node's word: a forged size would refuse every pull."""
        facts = model_facts(self._current(model), self._rows())
        return int(facts[0]["size_bytes"]) if facts is not None else 0

    def _ask(self, node_id: str, model: dict[str, Any], holders: list[dict[str, Any]]) -> Pull:
        size = self._size(model)
        sources = self._sources(node_id, model, holders)
        request = FetchRequest(
            str(uuid.uuid4()), model["sha256"], model["file_name"], size, sources, self.source_cidrs
        )
        self.running[request.transfer_id] = (node_id, request)
        self.uploads[sources[0].node_id] += 1  # a URL counts under "" and is never sorted
        if not self.gateway.fetch_model(node_id, request):
            self._ended(request.transfer_id)
            raise TransferRefused(f"node {node_id} is not connected to this controller")
        first = sources[0].node_id or sources[0].url
        log.info("node %s fetches %s from %s", node_id, model["file_name"], first)
        return Pull(node_id, request.transfer_id, tuple(s.node_id or s.url for s in sources))

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
                ended = self._ended(report.transfer_id)
                if ended is not None and report.state == "completed":
                    self.completed[(node_id, ended[1].sha256)] = self.clock()
                elif ended is not None:
                    self.failed[(node_id, ended[1].sha256)] = self.clock()
            await asyncio.to_thread(self.app.transfer_reported, node_id, report)
        except (DomainError, NotFound) as e:
            log.info("transfer %s on node %s: %s", report.transfer_id, node_id, e)
            return
        if report.state == "completed":
            self.on_model_added()
