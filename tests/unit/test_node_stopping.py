"""A node whose agent stops on purpose: NODE_STOPPING (it drains), then NODE_STOPPED (cleanly,
or with the jobs it still held lost), beside NODE_OFFLINE (lost without a goodbye)."""

from __future__ import annotations

import pytest

from domain.catalog import CATALOG, code_of
from domain.errors import IllegalTransition, InvalidCommand
from domain.node import Node
from domain.states import NodeState
from tests.unit.domain_builders import new_node, ready_node, replay


def codes(node: Node) -> list[str]:
    return [code_of(e) for e in node.collect_events()]


def test_the_events_are_in_the_catalog() -> None:
    assert CATALOG["NODE_STOPPING"] is Node.Stopping
    assert CATALOG["NODE_STOPPED"] is Node.Stopped


def test_a_stopping_node_drains_takes_no_job_and_stops_cleanly() -> None:
    node = ready_node(slots=2)
    node.assign_job("j1", "primary")
    node.collect_events()
    node.stop_draining(60.0)
    assert node.state == NodeState.DRAINING and node.stopping
    assert not node.schedulable
    with pytest.raises(IllegalTransition):
        node.assign_job("j2", "primary")
    # Its running job ends: it stays DRAINING (not READY) until its agent says goodbye.
    node.release_job("j1", "completed")
    assert node.state == NodeState.DRAINING
    node.stopped("drained (1 job(s) finished)")
    assert node.state == NodeState.OFFLINE and not node.stopping
    events = node.collect_events()
    assert [code_of(e) for e in events] == ["NODE_STOPPING", "NODE_JOB_RELEASED", "NODE_STOPPED"]
    stopping, stopped = events[0], events[-1]
    assert isinstance(stopping, Node.Stopping) and stopping.running_jobs == ["j1"]
    assert stopping.drain_timeout_seconds == 60.0
    assert isinstance(stopped, Node.Stopped) and stopped.lost_jobs == []


def test_a_stop_with_jobs_left_lists_them_lost() -> None:
    node = ready_node()
    node.assign_job("j1", "primary")
    node.rpc_worker_started("j1", "10.0.0.5", 50052)
    node.stop_draining(5.0)
    node.stopped("its drain timed out after 5 s with 1 job(s) running")
    stopped = node.collect_events()[-1]
    assert isinstance(stopped, Node.Stopped) and stopped.lost_jobs == ["j1"]
    assert node.jobs == [] and node.rpc_workers == {} and node.runtime is None


def test_a_restarted_agent_serves_again_and_an_admin_drain_outlives_a_stop() -> None:
    node = ready_node()
    node.stop_draining(60.0)
    node.stopped("drained (0 job(s) finished)")
    node.recover("0.3.0")
    assert node.state == NodeState.READY and not node.stopping
    node.request_drain("admin")
    node.stop_draining(60.0)
    node.stopped("drained (0 job(s) finished)")
    node.recover("0.3.0")
    assert node.state == NodeState.DRAINING and node.drain_requested


def test_an_admin_resume_does_not_end_a_stop() -> None:
    node = ready_node()
    node.request_drain("admin")
    node.stop_draining(60.0)
    node.resume("admin")
    assert node.state == NodeState.DRAINING and node.stopping


def test_a_crash_during_the_drain_clears_it() -> None:
    node = ready_node()
    node.stop_draining(60.0)
    node.heartbeat_timeout(7.0)
    assert node.state == NodeState.DEGRADED
    node.go_offline("no heartbeat for 16.0 s")
    assert not node.stopping
    node.recover()
    assert node.state == NodeState.READY


@pytest.mark.parametrize("setup", ["registering", "offline", "stopping", "revoked"])
def test_stop_draining_is_refused_out_of_service_or_twice(setup: str) -> None:
    node = new_node() if setup == "registering" else ready_node()
    if setup == "offline":
        node.go_offline("x")
    elif setup == "stopping":
        node.stop_draining(60.0)
    elif setup == "revoked":
        node.revoke("stolen", "admin")
    version = node.version
    with pytest.raises(IllegalTransition):
        node.stop_draining(60.0)
    assert node.version == version


def test_stopped_is_refused_when_offline_and_a_negative_timeout_is_invalid() -> None:
    node = ready_node()
    with pytest.raises(InvalidCommand):
        node.stop_draining(-1.0)
    node.go_offline("x")
    with pytest.raises(IllegalTransition):
        node.stopped("late goodbye")


def test_replay_rebuilds_the_stop() -> None:
    node = ready_node()
    node.assign_job("j1", "primary")
    node.stop_draining(60.0)
    again = replay(list(node.collect_events()))
    assert again.state == NodeState.DRAINING and again.stopping and again.jobs == ["j1"]
    again.stopped("bye")
    assert codes(again)[-1] == "NODE_STOPPED"
