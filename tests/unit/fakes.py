"""Fakes for fast orchestration tests: an in-memory read model that projects the application's
own notification log on every query (read-your-writes by construction), and an agent gateway
that records what it was asked to send and answers nothing until the test says so."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from application.commands import FetchRequest
from application.controller import Controller
from application.ports import AllowedPeer, LinkProbeRequest, PrimaryAssignment
from application.read_models import eligibility_of, project_job, project_model, project_node


class FakeReadModel:
    """The read-model port over dicts, caught up from the store before every query."""

    def __init__(self, app: Controller) -> None:
        self.app = app
        self.position = 0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.models: dict[str, dict[str, Any]] = {}
        self.model_ids: dict[str, str] = {}

    def catch_up(self) -> None:
        while True:
            batch = self.app.recorder.select_notifications(self.position + 1, 500)
            if not batch:
                return
            for notification in batch:
                event = self.app.mapper.to_domain_event(notification)
                ident = str(event.originator_id)
                if (row := project_node(self.nodes.get(ident), event)) is not None:
                    self.nodes[ident] = row
                elif (row := project_job(self.jobs.get(ident), event)) is not None:
                    self.jobs[ident] = row
                elif (row := project_model(self.models.get(ident), event)) is not None:
                    self.models[ident] = row
                self.position = notification.id

    def get_node(self, node_id: str) -> dict[str, Any] | None:
        self.catch_up()
        return self.nodes.get(node_id)

    def list_nodes(self) -> list[dict[str, Any]]:
        self.catch_up()
        return list(self.nodes.values())

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        self.catch_up()
        return self.jobs.get(job_id)

    def list_jobs(
        self,
        *,
        state: str | None = None,
        model: str | None = None,
        node_id: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        self.catch_up()
        rows = [
            r
            for r in self.jobs.values()
            if (state is None or r["state"] == state)
            and (model is None or r["model"] == model)
            and (node_id is None or node_id in r["nodes"])
        ]
        return rows[offset : offset + limit]

    def job_ids_starting(self, prefix: str, limit: int = 10) -> list[str]:
        self.catch_up()
        return sorted(j for j in self.jobs if j.startswith(prefix))[:limit]

    def eligibility(self) -> list[dict[str, Any]]:
        self.catch_up()
        return [e for n in self.nodes.values() if (e := eligibility_of(n)) is not None]

    def get_model(self, name: str) -> dict[str, Any] | None:
        self.catch_up()
        return next((m for m in self.models.values() if m["name"] == name), None)

    def list_models(self) -> list[dict[str, Any]]:
        self.catch_up()
        return list(self.models.values())


@dataclass
class FakeAgentGateway:
    """Records every control message; ``disconnected`` nodes refuse them."""

    disconnected: set[str] = field(default_factory=set)
    workers: list[tuple[str, str]] = field(default_factory=list)  # (node, job)
    #: The addresses each worker start let in (the plan's primary).
    allowed_peers: list[tuple[str, ...]] = field(default_factory=list)
    #: (node, the exact set) of each worker start.
    worker_sets: list[tuple[str, tuple[AllowedPeer, ...]]] = field(default_factory=list)
    #: (node, the set left) each time a job stopped using a worker (``RpcWorkerPeers``).
    peer_updates: list[tuple[str, tuple[AllowedPeer, ...]]] = field(default_factory=list)
    primaries: list[tuple[str, PrimaryAssignment]] = field(default_factory=list)
    cancels: list[tuple[str, str]] = field(default_factory=list)
    #: Nodes told to stop their RPC worker, with the reason.
    worker_stops: list[tuple[str, str]] = field(default_factory=list)
    server_stops: list[tuple[str, str]] = field(default_factory=list)
    link_probes: list[tuple[str, LinkProbeRequest]] = field(default_factory=list)
    #: Nodes asked to delete a model file.
    evictions: list[tuple[str, str]] = field(default_factory=list)
    #: Nodes asked to fetch a model file.
    fetches: list[tuple[str, FetchRequest]] = field(default_factory=list)
    #: Set on every primary assignment (the job manager calls from the event loop).
    assigned: asyncio.Event = field(default_factory=asyncio.Event)
    #: (node, devices) of every RPC worker start, in order.
    worker_devices: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    #: Set on every RPC worker start.
    worker_asked: asyncio.Event = field(default_factory=asyncio.Event)
    #: Nodes told to drain, to resume, and revoked nodes announced (``Drain``, ``Resume``,
    #: ``NodesRevoked``), in order.
    drains: list[str] = field(default_factory=list)
    resumes: list[str] = field(default_factory=list)
    revocations: list[str] = field(default_factory=list)

    def is_connected(self, node_id: str) -> bool:
        return node_id not in self.disconnected

    def start_rpc_worker(
        self,
        node_id: str,
        job_id: str,
        host: str,
        port: int,
        allowed: tuple[AllowedPeer, ...],
        devices: tuple[str, ...] = (),
    ) -> bool:
        self.workers.append((node_id, job_id))
        self.worker_devices.append((node_id, devices))
        self.allowed_peers.append(tuple(peer.address for peer in allowed))
        self.worker_sets.append((node_id, allowed))
        self.worker_asked.set()
        return self.is_connected(node_id)

    def rpc_worker_peers(self, node_id: str, allowed: tuple[AllowedPeer, ...], reason: str) -> bool:
        self.peer_updates.append((node_id, allowed))
        return self.is_connected(node_id)

    def fetch_model(self, node_id: str, request: FetchRequest) -> bool:
        self.fetches.append((node_id, request))
        return self.is_connected(node_id)

    def evict_model(self, node_id: str, sha256: str) -> bool:
        self.evictions.append((node_id, sha256))
        return self.is_connected(node_id)

    def stop_rpc_worker(self, node_id: str, reason: str) -> bool:
        self.worker_stops.append((node_id, reason))
        return self.is_connected(node_id)

    def stop_server(self, node_id: str, reason: str) -> bool:
        self.server_stops.append((node_id, reason))
        return self.is_connected(node_id)

    def probe_links(self, node_id: str, request: LinkProbeRequest) -> bool:
        self.link_probes.append((node_id, request))
        return self.is_connected(node_id)

    def assign_primary(self, node_id: str, assignment: PrimaryAssignment) -> bool:
        self.primaries.append((node_id, assignment))
        self.assigned.set()
        return self.is_connected(node_id)

    def cancel_job(self, node_id: str, job_id: str, reason: str) -> bool:
        self.cancels.append((node_id, job_id))
        return True

    def drain(self, node_id: str) -> bool:
        self.drains.append(node_id)
        return self.is_connected(node_id)

    def resume(self, node_id: str) -> bool:
        self.resumes.append(node_id)
        return self.is_connected(node_id)

    def revoke(self, node_id: str) -> bool:
        self.revocations.append(node_id)
        return self.is_connected(node_id)
