from __future__ import annotations

import pytest

from domain.catalog import code_of
from domain.errors import IllegalTransition, InvalidCommand
from domain.node import Node, resources_differ
from domain.states import NodeState
from tests.unit.domain_builders import new_node, ready_node


def assert_refused(node: Node, command) -> None:  # type: ignore[no-untyped-def]
    before_state, before_version = node.state, node.version
    before_pending = len(node.pending_events)
    with pytest.raises(IllegalTransition):
        command(node)
    assert node.state == before_state
    assert node.version == before_version
    assert len(node.pending_events) == before_pending


def test_enroll_registers_then_ready() -> None:
    node = new_node()
    assert node.state == NodeState.REGISTERING
    node.become_ready()
    assert node.state == NodeState.READY
    assert [code_of(e) for e in node.collect_events()] == ["NODE_ENROLLED", "NODE_READY"]


def test_enroll_validates_input() -> None:
    with pytest.raises(InvalidCommand):
        Node.enroll(
            node_id=None,
            name=" ",
            inventory={},
            agent_version="",
            address="",
            rpc_port=1,
            labels={},
            credential_sha256="",
            token_id="",
        )


def test_busy_when_all_slots_taken_and_ready_again_when_released() -> None:
    node = ready_node(slots=2)
    node.assign_job("j1", "primary")
    assert node.state == NodeState.READY
    node.assign_job("j2", "worker")
    assert node.state == NodeState.BUSY
    assert_refused(node, lambda n: n.assign_job("j3", "primary"))
    node.release_job("j1", "completed")
    assert node.state == NodeState.READY


def test_heartbeat_timeout_offline_recover() -> None:
    node = ready_node()
    node.heartbeat_timeout(7.0)
    assert node.state == NodeState.DEGRADED
    assert_refused(node, lambda n: n.heartbeat_timeout(8.0))
    node.go_offline("heartbeat gone")
    assert node.state == NodeState.OFFLINE
    assert_refused(node, lambda n: n.go_offline("again"))
    node.recover("0.2.0")
    assert node.state == NodeState.READY
    assert node.agent_version == "0.2.0"


def test_offline_drops_jobs_and_reports_them() -> None:
    node = ready_node()
    node.assign_job("j1", "primary")
    node.go_offline("stream closed")
    event = node.collect_events()[-1]
    assert isinstance(event, Node.WentOffline)
    assert event.lost_jobs == ["j1"]
    assert node.jobs == []


def test_drain_idle_node_drains_at_once() -> None:
    node = ready_node()
    node.request_drain("admin")
    assert node.state == NodeState.DRAINING
    assert node.complete_drain_if_idle()
    assert node.drained
    assert_refused(node, lambda n: n.request_drain("admin"))
    assert_refused(node, lambda n: n.assign_job("j", "primary"))
    node.resume("admin")
    assert node.state == NodeState.READY
    assert_refused(node, lambda n: n.resume("admin"))


def test_drain_busy_node_waits_for_last_job() -> None:
    node = ready_node()
    node.assign_job("j1", "primary")
    node.request_drain("admin")
    assert node.state == NodeState.DRAINING
    assert not node.complete_drain_if_idle()
    node.release_job("j1", "completed")
    assert node.state == NodeState.DRAINING
    assert node.complete_drain_if_idle()
    assert [code_of(e) for e in node.collect_events()][-1] == "NODE_DRAINED"


def test_draining_node_stays_draining_through_timeout_and_recovery() -> None:
    node = ready_node()
    node.request_drain("admin")
    node.heartbeat_timeout(9)
    assert node.state == NodeState.DEGRADED
    node.recover()
    assert node.state == NodeState.DRAINING


def test_degraded_is_fallback_only() -> None:
    node = ready_node()
    node.heartbeat_timeout(9)
    assert_refused(node, lambda n: n.assign_job("j", "primary"))
    node.assign_job("j", "primary", allow_degraded=True)
    assert node.state == NodeState.DEGRADED


def test_error_and_recovery() -> None:
    node = ready_node()
    node.assign_job("j1", "primary")
    node.report_error("GPU fell off the bus")
    assert node.state == NodeState.ERROR
    assert node.jobs == []
    assert_refused(node, lambda n: n.report_error("again"))
    node.recover()
    assert node.state == NodeState.READY


def test_registering_node_refuses_work() -> None:
    node = new_node()
    assert_refused(node, lambda n: n.assign_job("j", "primary"))
    assert_refused(node, lambda n: n.heartbeat_timeout(1))
    assert_refused(node, lambda n: n.request_drain("admin"))
    assert_refused(node, lambda n: n.report_error("x"))
    assert_refused(node, lambda n: n.recover())
    node.become_ready()
    assert_refused(node, lambda n: n.become_ready())


def test_rpc_worker_lifecycle() -> None:
    node = ready_node()
    assert_refused(node, lambda n: n.rpc_worker_started("j1", "10.0.0.5", 50052))
    node.assign_job("j1", "worker")
    node.rpc_worker_started("j1", "10.0.0.5", 50052)
    assert node.rpc_workers == {"j1": "10.0.0.5:50052"}
    with pytest.raises(InvalidCommand):
        node.rpc_worker_started("j1", "10.0.0.5", 0)
    node.rpc_worker_stopped("j1", "job ended")
    assert node.rpc_workers == {}
    assert_refused(node, lambda n: n.rpc_worker_stopped("j1", "again"))


def test_security_violation_recorded_in_any_state() -> None:
    node = new_node()
    node.security_violation("8.8.8.8", "outside ALLOWED_PEER_CIDRS")
    assert node.security_violations == 1
    assert code_of(node.collect_events()[-1]) == "SECURITY_VIOLATION"


def test_release_unknown_job_refused() -> None:
    assert_refused(ready_node(), lambda n: n.release_job("nope", "completed"))


def test_resource_reports_only_on_meaningful_change() -> None:
    node = ready_node()
    assert node.report_resources({"ram_free_bytes": 1000, "gpus": []}, [])
    assert not node.report_resources({"ram_free_bytes": 1050, "gpus": []}, [])
    assert node.report_resources({"ram_free_bytes": 500, "gpus": []}, [])
    assert node.report_resources({"ram_free_bytes": 500, "gpus": [{"name": "x"}]}, [])
    assert node.report_resources(
        {"ram_free_bytes": 500, "gpus": [{"name": "x"}]}, [{"sha256": "a"}]
    )


def test_resources_differ_rules() -> None:
    assert not resources_differ({"a_free_bytes": 100}, {"a_free_bytes": 105})
    assert resources_differ({"a_free_bytes": 100}, {"a_free_bytes": 150})
    assert resources_differ({"cpu": "x"}, {"cpu": "y"})
    assert resources_differ({"g": [{"m_free_bytes": 10}]}, {"g": [{"m_free_bytes": 100}]})
    assert not resources_differ({"g": [{"m_free_bytes": 100}]}, {"g": [{"m_free_bytes": 99}]})


def test_released_job_drops_its_rpc_worker_claim() -> None:
    node = ready_node()
    node.assign_job("j1", "worker")
    node.rpc_worker_started("j1", "10.0.0.5", 50052)
    node.release_job("j1", "completed")
    assert node.rpc_workers == {}
