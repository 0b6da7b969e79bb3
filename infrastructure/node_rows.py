"""Node and model rows in memory for the scheduler, kept current by the projection follower.

Every placement reads every node. With a thousand nodes, reading and decoding their rows from
the views' SQL table took longer than the decision itself, so the scheduler reads this copy
instead, and so does the health sweep: the same :func:`application.read_models.project_node`
applied to the same events, in the follower's thread, before the follower reports the event's
position as applied (so ``follower.wait(position)`` also means this copy has it). Model rows
too: every placement needs its model's current facts (a request's row may predate them), and
the model-claims sweep reads every model. Everything else reads the views.
"""

from __future__ import annotations

import threading
from typing import Any

from application.ports import ReadModel
from application.read_models import project_model, project_node
from domain.model import RegisteredModel, model_id
from domain.node import Node
from infrastructure.projection_follower import ProjectionFollower


class NodeRows:
    def __init__(self, views: ReadModel) -> None:
        self._views = views
        self._rows: dict[str, dict[str, Any]] = {}
        #: Model rows by model id (``model_id(name)``).
        self._models: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def attach(self, follower: ProjectionFollower) -> NodeRows:
        """Listens first, then loads: an event between the two is kept by version."""
        follower.add_event_listener(self._on_event)
        self.reload()
        return self

    def reload(self) -> None:
        rows = self._views.list_nodes()
        models = self._views.list_models()
        with self._lock:
            for row in rows:
                current = self._rows.get(row["node_id"])
                if current is None or int(current["version"]) < int(row["version"]):
                    self._rows[row["node_id"]] = row
            for model in models:
                ident = str(model_id(model["name"]))
                have = self._models.get(ident)
                # Rows projected before models had a version count as version 0.
                if have is None or int(have.get("version") or 0) < int(model.get("version") or 0):
                    self._models[ident] = model

    def _on_event(self, _position: int, event: object) -> None:
        if isinstance(event, RegisteredModel.Registered | RegisteredModel.Event):
            self._on_model_event(event)
            return
        if not isinstance(event, Node.Enrolled | Node.Event):
            return
        node_id = str(event.originator_id)
        with self._lock:
            row = self._rows.get(node_id)
            if row is not None and event.originator_version <= int(row["version"]):
                return  # already in the row (loaded after the follower applied it)
            new = project_node(row, event)
            if new is not None:
                self._rows[node_id] = new

    def _on_model_event(self, event: RegisteredModel.Registered | RegisteredModel.Event) -> None:
        ident = str(event.originator_id)
        with self._lock:
            row = self._models.get(ident)
            if row is not None and event.originator_version <= int(row.get("version") or 0):
                return
            new = project_model(row, event)
            if new is not None:
                self._models[ident] = new

    def list_nodes(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows.values())

    def get_model(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._models.get(str(model_id(name)))

    def list_models(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted(self._models.values(), key=lambda m: str(m["name"]))


class NodeRowsReadModel:
    """The :class:`~application.ports.ReadModel` of the scheduler and the health sweep
    (both read every node, often): nodes from :class:`NodeRows`, the rest from the views."""

    def __init__(self, views: ReadModel, nodes: NodeRows) -> None:
        self._views = views
        self._nodes = nodes

    def list_nodes(self) -> list[dict[str, Any]]:
        return self._nodes.list_nodes()

    def get_node(self, node_id: str) -> dict[str, Any] | None:
        return self._views.get_node(node_id)

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        return self._views.get_job(job_id)

    def list_jobs(self, **filters: Any) -> list[dict[str, Any]]:
        """The views' :meth:`~application.ports.ReadModel.list_jobs`, with its filters."""
        return self._views.list_jobs(**filters)

    def job_ids_starting(self, prefix: str, limit: int = 10) -> list[str]:
        return self._views.job_ids_starting(prefix, limit)

    def eligibility(self) -> list[dict[str, Any]]:
        return self._views.eligibility()

    def get_model(self, name: str) -> dict[str, Any] | None:
        return self._nodes.get_model(name)

    def list_models(self) -> list[dict[str, Any]]:
        return self._nodes.list_models()
