"""The controller over real Postgres and SQLite: persistence, concurrency, projections."""

from __future__ import annotations

import threading
from typing import Any
from uuid import UUID

import pytest
from eventsourcing.persistence import OperationalError, Tracking

from application.commands import Delta
from application.controller import Controller
from domain.catalog import code_of
from domain.errors import IllegalTransition, InvalidCommand
from domain.node import Node
from infrastructure import projection_follower
from infrastructure.projection_follower import POISON_AFTER, ProjectionFollower, rebuild
from infrastructure.read_model_store import open_read_model
from infrastructure.storage import Storage, open_storage
from tests.integration.store_builders import enroll_ready, run_job
from tests.plans import one_node_plan
from tests.unit.domain_builders import TWO_CHUNK_JOB_CODES


def test_append_and_reload_in_a_new_application(store_env: dict[str, str]) -> None:
    app = Controller(env=store_env)
    node_id = enroll_ready(app)
    job_id = run_job(app, node_id, "one two three")
    app.close()
    again = Controller(env=store_env)
    job = again.get_job(job_id)
    assert job.state == "COMPLETED"
    assert job.tokens_streamed == 3
    assert again.get_node(node_id).state == "READY"
    codes = [code_of(e) for e in again.repository.event_store.get(job_id)]
    assert codes == TWO_CHUNK_JOB_CODES
    again.close()


def test_node_snapshots_are_taken(store_env: dict[str, str]) -> None:
    app = Controller(env=store_env)
    node_id = enroll_ready(app)
    for i in range(60):
        app.security_violation(node_id, f"203.0.113.{i}", "test")
    assert app.snapshots is not None
    snapshots = list(app.snapshots.get(node_id))
    assert snapshots and snapshots[-1].originator_version == 50
    assert app.get_node(node_id).security_violations == 60
    app.close()


def test_concurrent_writers_lose_and_duplicate_nothing(store_env: dict[str, str]) -> None:
    first = Controller(env=store_env)
    second = Controller(env=store_env)
    node_id = enroll_ready(first)
    per_writer = 25
    errors: list[BaseException] = []

    def writer(app: Controller, tag: str) -> None:
        try:
            for i in range(per_writer):
                app.security_violation(node_id, f"{tag}-{i}", "race")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=writer, args=(first, "a")),
        threading.Thread(target=writer, args=(second, "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    events = list(first.repository.event_store.get(node_id))
    violations = [e.address for e in events if isinstance(e, Node.SecurityViolation)]
    assert sorted(violations) == sorted(
        [f"a-{i}" for i in range(per_writer)] + [f"b-{i}" for i in range(per_writer)]
    )
    assert [e.originator_version for e in events] == list(range(1, len(events) + 1))
    assert Controller(env=store_env).get_node(node_id).security_violations == 2 * per_writer
    first.close()
    second.close()


def test_token_chunks_for_many_jobs_in_one_transaction(storage: Storage) -> None:
    app = storage.app
    node_a = enroll_ready(app, "a")
    node_b = enroll_ready(app, "b")
    from tests.integration.test_event_store import _running_job

    job_a = _running_job(app, node_a)
    job_b = _running_job(app, node_b)
    before = app.position()
    position = app.record_token_chunks(
        {job_a: [Delta(0, "x"), Delta(1, "y")], job_b: [Delta(0, "z")]}
    )
    assert position == before + 2
    # All or nothing: a bad batch for one job records nothing for the other.
    with pytest.raises(InvalidCommand):
        app.record_token_chunks({job_a: [Delta(2, "ok")], job_b: [Delta(7, "bad")]})
    assert app.position() == position
    storage.follower.wait(position)
    assert storage.read_model.get_job(str(job_a))["text"] == "xy"  # type: ignore[index]
    assert storage.read_model.get_job(str(job_b))["tokens_streamed"] == 1  # type: ignore[index]


def test_token_chunks_after_another_writer_are_judged_on_its_state(
    store_env: dict[str, str],
) -> None:
    """The chunk path keeps the jobs it saved; a write by another controller is not lost."""
    here, there = Controller(env=store_env), Controller(env=store_env)
    node = enroll_ready(here, "a")
    job = _running_job(here, node)
    here.record_token_chunks({job: [Delta(0, "x")]})
    here.record_token_chunks({job: [Delta(1, "y")]})  # from the copy saved just before
    # Another controller ends the job; this one's copy is now behind the store.
    there.cancel(job, "cancelled elsewhere")
    with pytest.raises(IllegalTransition):
        here.record_token_chunks({job: [Delta(2, "z")]})
    codes = [code_of(e) for e in here.events.get(job)]
    assert codes[-3:] == ["TOKEN_STREAM_CHUNK", "TOKEN_STREAM_CHUNK", "JOB_CANCELLED"]
    # A bad batch leaves no unsaved event behind in the kept copy.
    other = _running_job(here, enroll_ready(here, "b"))
    third = _running_job(here, enroll_ready(here, "c"))
    here.record_token_chunks({other: [Delta(0, "x")]})
    with pytest.raises(InvalidCommand):
        here.record_token_chunks({other: [Delta(1, "ok")], third: [Delta(9, "bad")]})
    here.record_token_chunks({other: [Delta(1, "again")]})
    assert here.get_job(other).tokens_streamed == 2
    here.close()
    there.close()


def _running_job(app: Controller, node_id: UUID) -> UUID:
    from application.commands import ChatPrompt, Submission

    job_id = app.submit(
        Submission("m", ChatPrompt([{"role": "user", "content": "q"}]), stream=True)
    ).aggregate_id
    assert job_id is not None
    app.plan_and_dispatch(job_id, one_node_plan(node_id), {str(node_id): "primary"})
    app.validate_setup(job_id)
    return job_id


def test_read_your_writes(storage: Storage) -> None:
    node_id = enroll_ready(storage.app)
    position = storage.app.request_drain(node_id)
    storage.follower.wait(position, timeout=5)
    row = storage.read_model.get_node(str(node_id))
    assert row is not None
    assert row["state"] == "DRAINING" and row["drained"] is True
    assert storage.read_model.eligibility() == []
    with pytest.raises(TimeoutError):
        storage.follower.wait(position + 1000, timeout=0.3)


def test_read_models_reflect_nodes_jobs_and_eligibility(storage: Storage) -> None:
    app = storage.app
    node_a = enroll_ready(app, "a", ram=4 << 30)
    node_b = enroll_ready(app, "b", ram=8 << 30)
    job_id = run_job(app, node_a, "alpha beta")
    position = app.heartbeat_timeout(node_b, 7.0)
    storage.follower.wait(position)
    eligible = storage.read_model.eligibility()
    assert [(e["name"], e["fallback_only"]) for e in eligible] == [("a", False), ("b", True)]
    job = storage.read_model.get_job(str(job_id))
    assert job is not None
    assert job["state"] == "COMPLETED"
    assert job["text"] == "alpha beta"
    assert job["nodes"] == [str(node_a)]
    assert job["completion_tokens"] == 2
    assert storage.read_model.list_jobs(node_id=str(node_a))[0]["job_id"] == str(job_id)
    assert storage.read_model.list_jobs(node_id=str(node_b)) == []
    assert storage.read_model.list_jobs(state="FAILED") == []
    node_row = storage.read_model.get_node(str(node_b))
    assert node_row is not None and node_row["state"] == "DEGRADED"


def test_projection_catches_up_after_restart(store_env: dict[str, str]) -> None:
    first = open_storage(store_env).start()
    node_id = enroll_ready(first.app)
    first.follower.wait(first.app.position())
    first.close()
    # Events written while no projection runs.
    writer = Controller(env=store_env)
    for i in range(5):
        writer.security_violation(node_id, f"198.51.100.{i}", "while down")
    end = writer.position()
    writer.close()
    second = open_storage(store_env)
    assert second.follower.position == 2  # tracked position survived the restart
    assert second.follower.catch_up() == 5  # only the new events are applied
    second.follower.wait(end, timeout=1)
    row = second.read_model.get_node(str(node_id))
    assert row is not None and row["security_violations"] == 5
    second.close()


def test_rebuild_from_zero_yields_identical_rows(storage: Storage) -> None:
    app = storage.app
    a = enroll_ready(app, "a")
    b = enroll_ready(app, "b")
    run_job(app, a, "one two")
    job = _running_job(app, b)
    app.mark_offline(b, "stream closed")
    app.request_drain(a)
    storage.follower.wait(app.position())
    assert storage.read_model.get_job(str(job))["failure_phase"] == "execution"  # type: ignore[index]
    shadow = open_read_model(storage.env, view_name="dacp_rebuild")
    applied = rebuild(app, shadow)
    assert applied == app.position()
    assert shadow.dump() == storage.read_model.dump()
    # Rebuilding again (from zero) is idempotent.
    rebuild(app, shadow)
    assert shadow.dump() == storage.read_model.dump()


def test_one_batch_yields_the_rows_of_one_event_at_a_time(storage: Storage) -> None:
    app = storage.app
    a = enroll_ready(app, "a")
    run_job(app, a, "many words in several chunks of one job")
    _running_job(app, a)
    storage.follower.wait(app.position())
    single = open_read_model(storage.env, view_name="dacp_single")
    batched = open_read_model(storage.env, view_name="dacp_batched")
    notifications = app.recorder.select_notifications(1, 10_000)
    items = [
        (app.mapper.to_domain_event(n), Tracking(batched.view_name, n.id)) for n in notifications
    ]
    for event, tracking in items:
        single.process_event(event, Tracking(single.view_name, tracking.notification_id))
    batched.process_events(items)
    assert batched.dump() == single.dump() == storage.read_model.dump()


def test_follower_applies_live_events(storage: Storage) -> None:
    node_id = enroll_ready(storage.app)
    follower: ProjectionFollower = storage.follower
    position = storage.app.mark_offline(node_id, "gone")
    follower.wait(position, timeout=5)
    row = storage.read_model.get_node(str(node_id))
    assert row is not None and row["state"] == "OFFLINE"


def follow_by_hand(storage: Storage) -> UUID:
    """Stops the live follower (the test drives one by hand), then enrolls a ready node: the
    store's positions 1 and 2."""
    storage.follower.stop()
    return enroll_ready(storage.app, "a")


def test_catching_up_reads_the_store_once_when_a_batch_holds_what_it_has(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch shorter than BATCH was everything: no second read finds nothing (under load,
    two of every three reads the follower made)."""
    node_id = follow_by_hand(storage)
    app = storage.app
    reads: list[int] = []
    real = app.recorder.select_notifications

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        reads.append(len(found))
        return found

    monkeypatch.setattr(app.recorder, "select_notifications", counted)
    follower = ProjectionFollower(app, storage.read_model)
    assert follower.catch_up() == 2
    assert reads == [2]
    monkeypatch.setattr(projection_follower, "BATCH", 2)
    for reason in ("a", "b", "c"):
        app.security_violation(node_id, "198.51.100.1", reason)  # positions 3 to 5
    assert follower.catch_up() == 3
    assert reads == [2, 2, 1]  # a full batch, then one that was all there was
    assert follower.position == app.position() == 5
    assert follower.catch_up() == 0 and reads[-1] == 0


def test_an_event_the_views_cannot_take_is_skipped_not_fatal(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_id = follow_by_hand(storage)
    app = storage.app
    app.security_violation(node_id, "198.51.100.1", "x")  # position 3
    real = storage.read_model.process_event

    def broken(event: object, tracking: Any) -> None:
        if tracking.notification_id == 2:
            raise RuntimeError("a bug in a projection")
        real(event, tracking)  # type: ignore[arg-type]

    def broken_batch(items: list[tuple[object, Any]]) -> None:
        if any(tracking.notification_id == 2 for _, tracking in items):
            raise RuntimeError("a bug in a projection")
        real_batch(items)

    real_batch = storage.read_model.process_events
    monkeypatch.setattr(storage.read_model, "process_event", broken)
    monkeypatch.setattr(storage.read_model, "process_events", broken_batch)
    follower = ProjectionFollower(app, storage.read_model)
    for _ in range(POISON_AFTER - 1):
        with pytest.raises(RuntimeError):
            follower.catch_up()
    assert follower.catch_up() == 2  # skips 2 after the last failure, then applies 3
    assert follower.skipped == [2]
    assert follower.position == 3
    [skip] = storage.read_model.list_skips([str(node_id)])
    assert (skip["notification_id"], skip["event"]) == (2, "Node.BecameReady")
    assert skip["error"] == "RuntimeError: a bug in a projection"
    assert storage.read_model.list_skips(["someone-else"]) == []
    # Recorded in the store: a follower started later still counts it.
    assert ProjectionFollower(app, storage.read_model).skipped == [2]
    row = storage.read_model.get_node(str(node_id))
    assert row is not None and row["security_violations"] == 1
    assert storage.read_model.max_tracking_id(storage.read_model.view_name) == 3


def test_an_unreachable_store_is_retried_and_never_skips_an_event(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_id = follow_by_hand(storage)
    app = storage.app
    outage = {"left": 2 * POISON_AFTER}  # longer than the poison threshold
    real, real_batch = storage.read_model.process_event, storage.read_model.process_events

    def down(event: object, tracking: Any) -> None:
        if outage["left"] > 0:
            outage["left"] -= 1
            raise OperationalError("server closed the connection unexpectedly")
        real(event, tracking)  # type: ignore[arg-type]

    def down_batch(items: list[tuple[object, Any]]) -> None:
        if outage["left"] > 0:
            raise OperationalError("server closed the connection unexpectedly")
        real_batch(items)

    monkeypatch.setattr(storage.read_model, "process_event", down)
    monkeypatch.setattr(storage.read_model, "process_events", down_batch)
    follower = ProjectionFollower(app, storage.read_model)
    while outage["left"] > 0:
        with pytest.raises(OperationalError):
            follower.catch_up()
    assert follower.catch_up() == 2
    assert follower.skipped == []  # nothing lost to the outage
    row = storage.read_model.get_node(str(node_id))
    assert row is not None and row["state"] == "READY"
