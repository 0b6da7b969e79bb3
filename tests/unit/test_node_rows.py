"""NodeRows: the scheduler's in-memory node rows equal the views' rows, event by event."""

from __future__ import annotations

from collections.abc import Callable

from domain.runtimes import runtime_of
from infrastructure.node_rows import NodeRows, NodeRowsReadModel
from tests.unit.fakes import FakeReadModel
from tests.unit.job_cluster import Cluster
from tests.unit.test_runtimes import plan


class FakeFollower:
    """Hands each stored event to the listeners, as the projection follower does."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.position = 0
        self.listeners: list[Callable[[int, object], None]] = []

    def add_event_listener(self, listener: Callable[[int, object], None]) -> None:
        self.listeners.append(listener)

    def deliver(self, *, again_from: int | None = None) -> None:
        start = self.position + 1 if again_from is None else again_from
        app = self.cluster.app
        for notification in app.recorder.select_notifications(start, 100_000):
            for listener in self.listeners:
                listener(notification.id, app.mapper.to_domain_event(notification))
            self.position = max(self.position, notification.id)


async def test_rows_follow_the_events_and_match_the_views() -> None:
    cluster = Cluster(nodes=2, slots=4)
    follower = FakeFollower(cluster)
    views = FakeReadModel(cluster.app)
    rows = NodeRows(views).attach(follower)  # type: ignore[arg-type]
    follower.position = cluster.app.recorder.max_notification_id() or 0
    node = cluster.node_ids[0]
    runtime = runtime_of(plan(node))
    aggregate = cluster.app.get_node(node)
    aggregate.assign_job("j1", "primary", runtime=runtime)
    cluster.app.save(aggregate)
    cluster.add_node("late")
    follower.deliver()
    assert sorted(rows.list_nodes(), key=lambda r: r["node_id"]) == sorted(
        views.list_nodes(), key=lambda r: r["node_id"]
    )
    # An event delivered twice (applied by the views before the rows were loaded) counts once.
    follower.deliver(again_from=1)
    mine = next(r for r in rows.list_nodes() if r["node_id"] == node)
    assert mine["current_jobs"] == ["j1"] and mine["runtime"] == runtime
    assert NodeRowsReadModel(views, rows).list_nodes() == rows.list_nodes()


async def test_model_rows_follow_the_events_and_match_the_views() -> None:
    """The scheduler reads each model's current facts from memory too."""
    cluster = Cluster(nodes=1)
    follower = FakeFollower(cluster)
    views = FakeReadModel(cluster.app)
    rows = NodeRows(views).attach(follower)  # type: ignore[arg-type]
    follower.position = cluster.app.recorder.max_notification_id() or 0
    cluster.app.add_model_source("m", "http://10.0.0.9/m.gguf")
    cluster.app.register_model("other", "b" * 64, "o.gguf")
    follower.deliver()
    follower.deliver(again_from=1)  # applied twice: counted once
    read = NodeRowsReadModel(views, rows)
    assert read.list_models() == sorted(views.list_models(), key=lambda m: m["name"])
    model = read.get_model("m")
    assert model is not None and model["sources"] == ["http://10.0.0.9/m.gguf"]
    assert model["shape_from"] == cluster.node_ids[0]  # its proof fixed the facts
    assert read.get_model("nobody") is None
