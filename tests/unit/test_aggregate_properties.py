"""Property tests: random command sequences against the Node and Job aggregates.

After every command, legal or refused, the aggregate equals the replay of its recorded
events, and every state change it made is an edge of the allowed graph (docs/lifecycles.md,
'Node state machine' and 'Job lifecycle').
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from domain.errors import DomainError
from domain.states import JobState, NodeState
from tests.unit.domain_builders import complete, new_job, new_node, replay

N = NodeState
NODE_EDGES = {
    (N.REGISTERING, N.READY),
    (N.REGISTERING, N.OFFLINE),
    (N.READY, N.BUSY),
    (N.BUSY, N.READY),
    (N.READY, N.DRAINING),
    (N.BUSY, N.DRAINING),
    (N.DRAINING, N.READY),
    (N.DRAINING, N.BUSY),
    (N.READY, N.DEGRADED),
    (N.BUSY, N.DEGRADED),
    (N.DRAINING, N.DEGRADED),
    (N.DEGRADED, N.READY),
    (N.DEGRADED, N.DRAINING),
    (N.DEGRADED, N.OFFLINE),
    (N.READY, N.OFFLINE),
    (N.BUSY, N.OFFLINE),
    (N.DRAINING, N.OFFLINE),
    (N.ERROR, N.OFFLINE),
    (N.OFFLINE, N.READY),
    (N.OFFLINE, N.DRAINING),
    (N.ERROR, N.READY),
    (N.ERROR, N.DRAINING),
    (N.READY, N.ERROR),
    (N.BUSY, N.ERROR),
    (N.DRAINING, N.ERROR),
    (N.DEGRADED, N.ERROR),
}

J = JobState
JOB_EDGES = (
    {
        (J.SUBMITTED, J.PLANNED),
        (J.PLANNED, J.PLANNED),
        (J.DISPATCHED, J.PLANNED),
        (J.PLANNED, J.DISPATCHED),
        (J.DISPATCHED, J.SETUP_VALIDATED),
        (J.SETUP_VALIDATED, J.RUNNING),
        (J.RUNNING, J.RUNNING),
        (J.SETUP_VALIDATED, J.COMPLETED),
        (J.RUNNING, J.COMPLETED),
    }
    | {(s, J.FAILED) for s in J if s not in (J.COMPLETED, J.FAILED, J.CANCELLED)}
    | {(s, J.CANCELLED) for s in J if s not in (J.COMPLETED, J.FAILED, J.CANCELLED)}
)

JOB_IDS = ["j1", "j2", "j3"]

node_commands = st.one_of(
    st.just(("become_ready",)),
    st.tuples(st.just("heartbeat_timeout"), st.floats(1, 100)),
    st.tuples(st.just("go_offline"), st.just("gone")),
    st.tuples(st.just("recover"), st.sampled_from(["", "0.2.0"])),
    st.tuples(st.just("request_drain"), st.just("admin")),
    st.just(("complete_drain_if_idle",)),
    st.tuples(st.just("resume"), st.just("admin")),
    st.tuples(st.just("report_error"), st.just("fault")),
    st.tuples(st.just("assign_job"), st.sampled_from(JOB_IDS), st.just("primary")),
    st.tuples(st.just("release_job"), st.sampled_from(JOB_IDS), st.just("completed")),
    st.tuples(
        st.just("rpc_worker_started"), st.sampled_from(JOB_IDS), st.just("10.0.0.2"), st.just(50052)
    ),
    st.tuples(st.just("rpc_worker_stopped"), st.sampled_from(JOB_IDS), st.just("done")),
    st.tuples(st.just("security_violation"), st.just("8.8.8.8"), st.just("public")),
    st.tuples(
        st.just("report_resources"),
        st.fixed_dictionaries({"ram_free_bytes": st.integers(0, 10_000)}),
        st.just([]),
    ),
)


def _check(aggregate: Any, recorded: list[Any], before: Any, edges: set[Any]) -> None:
    recorded.extend(aggregate.collect_events())
    rebuilt = replay(recorded)
    assert rebuilt.__dict__ == aggregate.__dict__
    if aggregate.state != before:
        assert (before, aggregate.state) in edges, (before, aggregate.state)


def _applied(
    aggregate: Any,
    commands: list[tuple[Any, ...]],
    edges: set[Any],
    apply: Callable[[str, list[Any]], None],
) -> Iterator[None]:
    """Applies each command in turn (a refused one must change nothing), checking the
    aggregate against its replay and the allowed edges; yields after each for more checks."""
    recorded: list[Any] = []
    _check(aggregate, recorded, aggregate.state, edges)
    for name, *args in commands:
        before = aggregate.state
        version = aggregate.version
        try:
            apply(name, args)
        except DomainError:
            assert aggregate.version == version
        _check(aggregate, recorded, before, edges)
        yield


@settings(max_examples=150, deadline=None)
@given(st.lists(node_commands, max_size=30), st.integers(1, 3))
def test_node_random_commands(commands: list[tuple[Any, ...]], slots: int) -> None:
    node = new_node(slots=slots)
    for _ in _applied(node, commands, NODE_EDGES, lambda name, args: getattr(node, name)(*args)):
        assert len(node.jobs) <= node.slots


job_commands = st.one_of(
    st.tuples(st.just("record_plan"), st.just({"p": 1})),
    st.tuples(st.just("replan"), st.just({"p": 2}), st.just("lost"), st.just("n2")),
    st.tuples(st.just("dispatch"), st.just(["n1"])),
    st.just(("validate_setup",)),
    st.just(("chunk",)),
    st.just(("complete",)),
    st.tuples(st.just("fail"), st.just("boom")),
    st.tuples(st.just("cancel"), st.just("client")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(job_commands, max_size=25))
def test_job_random_commands(commands: list[tuple[Any, ...]]) -> None:
    job = new_job()

    def apply(name: str, args: list[Any]) -> None:
        if name == "chunk":
            job.record_chunk([{"seq": job.next_seq, "text": "t", "tokens": 1}])
        elif name == "complete":
            complete(job)
        else:
            getattr(job, name)(*args)

    for _ in _applied(job, commands, JOB_EDGES, apply):
        if job.state == J.FAILED:
            assert job.failure_phase in ("setup", "execution")
