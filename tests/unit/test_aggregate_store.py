"""The event-store mechanics under the controller's commands (application/aggregate_store.py):
re-running a command that lost a version race, giving up after a bounded number of tries,
aggregates kept as last saved (the controller's unfinished jobs and its nodes), NotFound
naming the aggregate, and save listeners."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any
from uuid import UUID, uuid4

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event

from application.aggregate_store import MAX_COMMAND_ATTEMPTS, AggregateStore
from application.controller import Controller
from application.errors import ConcurrencyExhausted, NotFound
from application.store_guard import StoreGuard
from domain.catalog import code_of
from domain.node import Node
from domain.states import NodeState
from tests.unit.job_cluster import GIB, GUARD, Cluster, submission


class Counter(Aggregate):
    def __init__(self) -> None:
        self.count = 0

    @event("Incremented")
    def increment(self) -> None:
        self.count += 1


class Other(Aggregate):
    pass


def store_with_counter(*, keep: bool = False) -> tuple[Application[UUID], AggregateStore, UUID]:
    app: Application[UUID] = Application()
    store = AggregateStore(
        app, StoreGuard(lambda: True), kinds={Counter: "counter"}, keep_fresh=lambda a: keep
    )
    counter = Counter()
    app.save(counter)
    return app, store, counter.id


def stored_count(app: Application[UUID], uid: UUID) -> int:
    counter: Counter = app.repository.get(uid)
    return counter.count


def test_a_command_that_lost_a_race_runs_again_on_stored_state() -> None:
    app, store, uid = store_with_counter()
    stale: Counter = app.repository.get(uid)
    other: Counter = app.repository.get(uid)
    other.increment()
    app.save(other)  # another writer got there first
    attempts: list[Counter] = []

    def command() -> list[Aggregate]:
        counter = stale if not attempts else store.load(Counter, uid)
        attempts.append(counter)
        counter.increment()
        return [counter]

    position = store.run(command)
    assert len(attempts) == 2 and attempts[0] is stale
    assert stored_count(app, uid) == 2  # neither lost nor applied twice
    assert position == store.position()


def test_a_command_that_always_loses_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    app, store, uid = store_with_counter()
    template: Counter = app.repository.get(uid)
    newer: Counter = app.repository.get(uid)
    newer.increment()
    app.save(newer)
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)

    def command() -> list[Aggregate]:
        counter = copy.deepcopy(template)
        counter.increment()
        return [counter]

    with pytest.raises(ConcurrencyExhausted, match=f"after {MAX_COMMAND_ATTEMPTS} "):
        store.run(command)
    assert len(pauses) == MAX_COMMAND_ATTEMPTS  # a jittered pause after each loss
    assert stored_count(app, uid) == 1


def test_kept_aggregates_are_checked_out_and_dropped_after_a_conflict() -> None:
    app, store, uid = store_with_counter(keep=True)
    store.change(Counter, uid, lambda c: c.increment())
    kept = store.load(Counter, uid)
    assert kept.count == 1
    assert store.load(Counter, uid) is not kept  # checked out: the next load is the store's
    store.fresh.saved([kept])
    other: Counter = app.repository.get(uid)
    other.increment()
    app.save(other)  # the kept copy is stale now

    store.change(Counter, uid, lambda c: c.increment())
    assert stored_count(app, uid) == 3


def test_an_unknown_aggregate_is_named_by_its_kind() -> None:
    _app, store, uid = store_with_counter()
    missing = uuid4()
    with pytest.raises(NotFound, match=f"unknown counter {missing}"):
        store.get(Counter, missing)
    with pytest.raises(NotFound, match="unknown counter not-a-uuid"):
        store.load(Counter, "not-a-uuid")
    with pytest.raises(NotFound, match=f"unknown counter {missing}"):
        store.change(Counter, missing, lambda c: c.increment())
    assert store.find(Counter, missing) is None
    assert store.find(Counter, uid) is not None
    with pytest.raises(NotFound, match=f"unknown Other {uid}"):
        store.get(Other, uid)  # a counter, not an Other; no kind given: its class name


def test_listeners_and_the_append_observer_hear_of_every_save() -> None:
    app = Controller()
    positions: list[int] = []
    durations: list[float] = []
    app.add_save_listener(positions.append)
    app.append_observer = durations.append
    first = app.record_token("t1", expires_at=1.0, single_use=False, node_name=None, minted_by="a")
    app.remove_save_listener(positions.append)
    app.append_observer = None
    second = app.record_token("t2", expires_at=1.0, single_use=False, node_name=None, minted_by="a")
    assert positions == [first] and second > first == app.position() - 1
    assert len(durations) == 1


async def test_a_nodes_next_jobs_start_from_its_kept_copy_not_the_store() -> None:
    cluster = Cluster(nodes=1)
    [node_id] = cluster.node_ids
    node, job, _ = await cluster.running_job()
    await cluster.finish(node, job)
    reads: list[UUID] = []
    real_get = cluster.app.repository.get

    def counted(uid: UUID, *args: Any, **kwargs: Any) -> Any:
        reads.append(uid)
        return real_get(uid, *args, **kwargs)

    cluster.app.repository.get = counted  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [_, (node, job)] = await cluster.primary_assigned(2)
    await cluster.validate(node, job)
    await asyncio.wait_for(task, GUARD)
    await cluster.finish(node, job)
    assert UUID(node_id) not in reads  # dispatch and ending both used the kept node
    stored: Node = real_get(UUID(node_id))
    assert not stored.jobs
    codes = [code_of(e) for e in cluster.app.events.get(UUID(node_id))]
    assert codes.count("NODE_JOB_ASSIGNED") == codes.count("NODE_JOB_RELEASED") == 2


async def test_a_kept_node_another_controller_changed_costs_a_re_run_not_its_change() -> None:
    cluster = Cluster(nodes=1)
    [node_id] = cluster.node_ids
    node, job, _ = await cluster.running_job()
    await cluster.finish(node, job)  # the node is kept as last saved here
    rival: Node = cluster.app.repository.get(UUID(node_id))
    rival.stop_draining(30.0)
    cluster.app.save(rival)  # another controller's write: the kept copy is stale now
    saves: list[int] = []
    real_save = cluster.app.save

    def counted(*aggregates: Any, **kwargs: Any) -> Any:
        saves.append(len(aggregates))
        return real_save(*aggregates, **kwargs)

    cluster.app.save = counted  # type: ignore[method-assign]
    resources = {"ram_total_bytes": GIB, "ram_free_bytes": GIB, "gpus": []}
    cluster.app.report_resources(node_id, resources, [])
    assert saves == [1, 1]  # the kept copy's save conflicted; the re-run's was taken
    stored: Node = cluster.app.repository.get(UUID(node_id))
    assert stored.stopping and stored.state == NodeState.DRAINING  # the rival's change stands
    assert stored.resources == resources and stored.local_models == []  # and so does ours
