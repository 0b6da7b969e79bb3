"""Job endings are retried until the store takes them (issue 21, finding 7): a store outage
or version conflicts lost to other writers delay an ending, never drop it; and reconciliation
ends this controller's own jobs whose ending was lost. The real job manager on the in-memory
store with a fake gateway; the store's outage is simulated on the commands, the backoff and
the clock are injected (nothing sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import pytest

from application.agent_messages import SetupOutcome, SetupReported, TokensGenerated
from application.commands import Delta
from application.errors import ConcurrencyExhausted
from application.job_manager import ABANDONED, ENDING_RETRY_FIRST, ENDING_RETRY_MAX
from application.store_guard import StoreGuard, StoreUnavailable
from domain.catalog import code_of
from domain.errors import IllegalTransition
from domain.job import Job
from interfaces.controller_main import _own_unfinished_jobs
from tests.unit.job_cluster import GUARD, Cluster, submission

#: The store commands an ending or a re-plan writes with.
WRITES = ("fail", "cancel", "complete", "release_nodes", "validate_setup")


class Faulty:
    """Makes the app's writes raise ``error`` while ``down`` (or for the next ``times``)."""

    def __init__(self, cluster: Cluster, error: Callable[[], Exception]) -> None:
        self.error, self.down, self.times, self.refused = error, False, 0, 0
        for name in WRITES:
            setattr(cluster.app, name, self._wrap(getattr(cluster.app, name)))

    def _wrap(self, command: Callable[..., Any]) -> Callable[..., Any]:
        def faulty(*args: Any, **kwargs: Any) -> Any:
            if self.down or self.times > 0:
                self.times = max(0, self.times - 1)
                self.refused += 1
                raise self.error()
            return command(*args, **kwargs)

        faulty.__name__ = command.__name__
        return faulty


class Backoff:
    """The job manager's ``sleep``: records each wait; ``on_wait`` runs at the n-th."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.on_wait: dict[int, Callable[[], None]] = {}
        self.hold = asyncio.Event()
        self.hold.set()

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if (action := self.on_wait.get(len(self.waits))) is not None:
            action()
        await self.hold.wait()


def _cluster() -> tuple[Cluster, Backoff]:
    cluster = Cluster(nodes=1)
    backoff = Backoff()
    cluster.jobs.sleep = backoff
    return cluster, backoff


def _state(cluster: Cluster, job_id: str) -> str:
    return str(cluster.app.get_job(job_id).state)


def _ending_code(cluster: Cluster, job_id: str) -> str:
    """The error code of the job's last event (its ending)."""
    *_, last = cluster.app.events.get(UUID(job_id))
    return str(getattr(last, "error_code", ""))


def _slot_free(cluster: Cluster) -> bool:
    return not cluster.app.get_node(cluster.node_ids[0]).jobs


async def _dispatched(cluster: Cluster) -> tuple[asyncio.Task[Any], str, str]:
    task = asyncio.create_task(cluster.jobs.start(submission(), cluster.model))
    [(node, job_id)] = await cluster.primary_assigned(1)
    assert _state(cluster, job_id) == "DISPATCHED"
    return task, node, job_id


async def test_a_setup_ending_during_an_outage_is_written_once_the_store_is_back() -> None:
    cluster, backoff = _cluster()
    task, node, job_id = await _dispatched(cluster)
    outage = Faulty(cluster, lambda: StoreUnavailable("the event store is unreachable"))
    outage.down = True
    backoff.on_wait[3] = lambda: setattr(outage, "down", False)  # back after the third wait
    # The primary's setup fails while the store is down: the re-plan cannot be recorded.
    failed = SetupOutcome(ok=False, error="no file", error_code="MODEL_NOT_FOUND")
    await cluster.jobs.handle(node, SetupReported(job_id, failed))
    with pytest.raises(StoreUnavailable):  # the client hears at once
        await asyncio.wait_for(task, GUARD)
    await cluster.until(lambda: _state(cluster, job_id) == "FAILED")
    assert backoff.waits == [ENDING_RETRY_FIRST, 2 * ENDING_RETRY_FIRST, 4 * ENDING_RETRY_FIRST]
    assert _slot_free(cluster) and job_id not in cluster.jobs.runs
    # The node's only slot takes the next job, without a restart.
    nxt = asyncio.create_task(cluster.jobs.start(submission("next"), cluster.model))
    [_, (again, second)] = await cluster.primary_assigned(2)
    assert again == node
    await cluster.validate(node, second)
    await asyncio.wait_for(nxt, GUARD)


async def test_the_backoff_between_attempts_is_capped() -> None:
    cluster, backoff = _cluster()
    task, _node, job_id = await _dispatched(cluster)
    outage = Faulty(cluster, lambda: StoreUnavailable("the event store is unreachable"))
    outage.down = True
    backoff.on_wait[8] = lambda: setattr(outage, "down", False)
    await cluster.jobs.cancel(job_id, "client went away")  # waits until written
    assert _state(cluster, job_id) == "CANCELLED" and _slot_free(cluster)
    assert max(backoff.waits) == ENDING_RETRY_MAX and len(backoff.waits) == 8
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_version_conflicts_are_retried_with_a_fresh_read_not_given_up() -> None:
    cluster, backoff = _cluster()
    task, node, job_id = await _dispatched(cluster)
    await cluster.validate(node, job_id)
    run = await asyncio.wait_for(task, GUARD)
    conflicts = Faulty(cluster, lambda: ConcurrencyExhausted("gave up after 10 conflicts"))
    conflicts.times = 3  # MAX_COMMAND_ATTEMPTS conflicts, three times over
    await cluster.finish(node, job_id)
    await cluster.until(lambda: _state(cluster, job_id) == "COMPLETED")
    assert conflicts.refused == 3 and len(backoff.waits) == 3
    assert _slot_free(cluster)
    item = run.queue.get_nowait()
    assert item.kind == "done"


class Saves:
    """The codes of the events each of the app's saves (transactions) wrote, in order."""

    def __init__(self, cluster: Cluster) -> None:
        self.codes: list[list[str]] = []
        real = cluster.app.save

        def save(*aggregates: Any, **kwargs: Any) -> Any:
            recordings = real(*aggregates, **kwargs)
            self.codes.append([code_of(r.domain_event) for r in recordings])
            return recordings

        cluster.app.save = save  # type: ignore[method-assign]


async def _running(cluster: Cluster) -> tuple[str, str]:
    """A job whose setup is validated and recorded: it streams."""
    task, node, job_id = await _dispatched(cluster)
    await cluster.validate(node, job_id)
    run = await asyncio.wait_for(task, GUARD)
    await asyncio.wait_for(run.validated.wait(), GUARD)
    return node, job_id


async def test_the_last_tokens_and_the_ending_are_one_transaction() -> None:
    """The deltas still pending when the job ends are its last chunk, written with its ending
    (one transaction, not two): and before it, as every chunk precedes the ending."""
    cluster, _ = _cluster()
    node, job_id = await _running(cluster)
    saves = Saves(cluster)
    await cluster.jobs.handle(node, TokensGenerated(job_id, [Delta(0, "Hi"), Delta(1, "!")]))
    await cluster.finish(node, job_id)
    assert saves.codes == [["TOKEN_STREAM_CHUNK", "JOB_COMPLETED", "NODE_JOB_RELEASED"]]
    [chunk] = [
        e for e in cluster.app.events.get(UUID(job_id)) if isinstance(e, Job.TokenStreamChunk)
    ]
    assert [d["seq"] for d in chunk.deltas] == [0, 1]


async def test_the_last_tokens_wait_out_an_outage_with_their_ending() -> None:
    cluster, backoff = _cluster()
    node, job_id = await _running(cluster)
    await cluster.jobs.handle(node, TokensGenerated(job_id, [Delta(0, "Hi")]))
    outage = Faulty(cluster, lambda: StoreUnavailable("the event store is unreachable"))
    outage.times = 2
    saves = Saves(cluster)
    await cluster.finish(node, job_id)
    await cluster.until(lambda: _state(cluster, job_id) == "COMPLETED")
    assert len(backoff.waits) == 2
    assert saves.codes == [["TOKEN_STREAM_CHUNK", "JOB_COMPLETED", "NODE_JOB_RELEASED"]]


async def test_last_tokens_out_of_sequence_are_dropped_and_the_ending_stands() -> None:
    cluster, _ = _cluster()
    node, job_id = await _running(cluster)
    await cluster.jobs.handle(node, TokensGenerated(job_id, [Delta(0, "Hi")]))
    await cluster.jobs.recorder.flush_all()  # seq 0 recorded
    cluster.jobs.recorder.add(job_id, [Delta(0, "again")])  # 0 again: refused
    await cluster.finish(node, job_id)
    assert _state(cluster, job_id) == "COMPLETED" and _slot_free(cluster)
    codes = [code_of(e) for e in cluster.app.events.get(UUID(job_id))]
    assert codes.count("TOKEN_STREAM_CHUNK") == 1


async def test_tokens_of_an_ending_refused_are_recorded_with_the_next_batch() -> None:
    """The ending took the job's pending deltas; refused (the job's state forbids it), it is
    skipped and they are pending again, before any that came since."""
    cluster, _ = _cluster()
    node, job_id = await _running(cluster)
    await cluster.jobs.handle(node, TokensGenerated(job_id, [Delta(0, "a")]))
    refused = Faulty(cluster, lambda: IllegalTransition("Job", "complete", "RUNNING", "test"))
    refused.times = 1
    await cluster.finish(node, job_id)
    assert refused.refused == 1 and _state(cluster, job_id) == "SETUP_VALIDATED"  # no ending
    cluster.jobs.recorder.add(job_id, [Delta(1, "b")])
    await cluster.jobs.recorder.flush_all()
    [chunk] = [
        e for e in cluster.app.events.get(UUID(job_id)) if isinstance(e, Job.TokenStreamChunk)
    ]
    assert [d["text"] for d in chunk.deltas] == ["a", "b"]


async def test_reconciliation_ends_its_own_jobs_left_unfinished_after_the_grace() -> None:
    cluster, _ = _cluster()
    now = [100.0]
    cluster.jobs.clock = lambda: now[0]
    task, _node, job_id = await _dispatched(cluster)
    # An ending lost to a fault that is not the store's state (a bug): logged, given up.
    Faulty(cluster, lambda: RuntimeError("a bug")).times = 1
    await cluster.jobs.cancel(job_id, "client went away")
    assert _state(cluster, job_id) == "DISPATCHED" and not _slot_free(cluster)

    async def listed() -> list[str]:
        return [job_id]

    assert await cluster.jobs.end_stale_jobs(listed, grace=30) == []
    now[0] += 29.9
    assert await cluster.jobs.end_stale_jobs(listed, grace=30) == []
    now[0] += 0.1
    assert await cluster.jobs.end_stale_jobs(listed, grace=30) == [job_id]
    await cluster.until(lambda: _state(cluster, job_id) == "FAILED")
    assert _ending_code(cluster, job_id) == ABANDONED
    assert _slot_free(cluster)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_reconciliation_leaves_live_runs_and_endings_under_way_alone() -> None:
    cluster, backoff = _cluster()
    now = [0.0]
    cluster.jobs.clock = lambda: now[0]
    task, _node, job_id = await _dispatched(cluster)

    async def listed() -> list[str]:
        return [job_id]

    now[0] += 1000
    assert await cluster.jobs.end_stale_jobs(listed, grace=30) == []  # it runs here
    # Its ending waits for the store: reconciliation does not end it a second time.
    outage = Faulty(cluster, lambda: StoreUnavailable("the event store is unreachable"))
    outage.down = True
    backoff.hold.clear()
    ending = asyncio.create_task(cluster.jobs.cancel(job_id, "client went away"))
    await asyncio.sleep(0)
    while not backoff.waits:
        await asyncio.sleep(0)
    for _ in range(2):
        now[0] += 1000
        assert await cluster.jobs.end_stale_jobs(listed, grace=30) == []
    outage.down = False
    backoff.hold.set()
    await asyncio.wait_for(ending, GUARD)
    assert _state(cluster, job_id) == "CANCELLED"
    assert _ending_code(cluster, job_id) != ABANDONED
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_only_this_controllers_unfinished_jobs_are_reconciled() -> None:
    rows = {
        "SUBMITTED": [{"job_id": "mine-1", "controller": "me"}],
        "DISPATCHED": [
            {"job_id": "mine-2", "controller": "me"},
            {"job_id": "theirs", "controller": "other"},
            {"job_id": "old", "controller": ""},
        ],
        "COMPLETED": [{"job_id": "done", "controller": "me"}],
    }

    def list_jobs(*, state: str, limit: int) -> list[dict[str, str]]:
        return rows.get(state, [])

    services: Any = SimpleNamespace(
        app=SimpleNamespace(guard=StoreGuard(probe=lambda: True), owner="me"),
        read_model=SimpleNamespace(list_jobs=list_jobs),
    )
    assert sorted(_own_unfinished_jobs(services)) == ["mine-1", "mine-2"]
