"""Slots per running server (domain/runtimes.py, Node.assign_job) and slot choice in plans."""

from __future__ import annotations

from typing import Any

import pytest

from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.errors import IllegalTransition, InvalidCommand
from domain.placement import (
    MIB,
    Candidate,
    ExecutionPlan,
    ModelNeeds,
    PlacementRequest,
    PlanNode,
)
from domain.runtimes import runtime_of, warm_choice, warm_choices
from domain.split_planner import plan_placement
from domain.states import NodeState
from tests.unit.domain_builders import ready_node

SHA = "ab" * 32


def plan(*node_ids: str, parallel: int = 4, context: int = 2048, sha: str = SHA) -> ExecutionPlan:
    share = 1 / len(node_ids)
    nodes = [PlanNode(n, f"10.0.0.{i + 1}", 50052, 1) for i, n in enumerate(node_ids)]
    return ExecutionPlan(
        model_name="m",
        model_sha256=sha,
        model_file_name="m.gguf",
        context_size=context,
        required_bytes=1,
        primary=nodes[0],
        workers=tuple(nodes[1:]),
        tensor_split=(1 - share * (len(node_ids) - 1), *[share] * (len(node_ids) - 1)),
        parallel=parallel,
    )


# --- Node: one runtime at a time, counted against its slots --------------------------------


def test_a_node_holds_as_many_jobs_as_its_runtime_has_slots() -> None:
    node = ready_node(slots=4)
    runtime = runtime_of(plan("n", parallel=3))
    for i in range(3):
        node.assign_job(f"j{i}", "primary", runtime=runtime)
    assert node.state == NodeState.BUSY and node.capacity == 3
    with pytest.raises(IllegalTransition):
        node.assign_job("j3", "primary", runtime=runtime)
    node.release_job("j0", "completed")
    assert node.state == NodeState.READY


def test_a_node_with_jobs_refuses_a_job_of_another_runtime_until_idle() -> None:
    node = ready_node(slots=4)
    first, other = runtime_of(plan("n")), runtime_of(plan("n", parallel=2))
    node.assign_job("j1", "primary", runtime=first)
    with pytest.raises(IllegalTransition, match="another model"):
        node.assign_job("j2", "primary", runtime=other)
    node.release_job("j1", "completed")
    assert node.runtime == first  # stays warm after its last job
    node.assign_job("j2", "primary", runtime=other)
    assert node.runtime == other


def test_a_primary_never_gets_more_slots_than_it_offers() -> None:
    node = ready_node(slots=2)
    with pytest.raises(InvalidCommand):
        node.assign_job("j1", "primary", runtime=runtime_of(plan("n", parallel=3)))


def test_a_worker_is_shared_by_all_slots_of_its_server() -> None:
    worker = ready_node(slots=1)  # its own slot cap limits it as a primary only
    runtime = runtime_of(plan("p", "w", parallel=4))
    for i in range(4):
        worker.assign_job(f"j{i}", "worker", runtime=runtime)
    assert worker.state == NodeState.BUSY and len(worker.jobs) == 4


def test_going_offline_forgets_the_warm_runtime() -> None:
    node = ready_node(slots=4)
    node.assign_job("j1", "primary", runtime=runtime_of(plan("n")))
    node.go_offline("gone")
    assert node.runtime is None


# --- warm_choice ------------------------------------------------------------------------------


def row(
    node_id: str, runtime: dict[str, Any] | None, jobs: int = 0, state: str = "READY"
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "state": state,
        "drain_requested": False,
        "current_jobs": [f"{node_id}-{i}" for i in range(jobs)],
        "runtime": runtime,
        "slots": 4,
    }


def test_the_warm_server_with_most_free_slots_is_chosen() -> None:
    a, b = runtime_of(plan("a")), runtime_of(plan("b"))
    rows = {"a": row("a", a, jobs=3), "b": row("b", b, jobs=1)}
    choice = warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048)
    assert choice is not None and choice.plan.primary.node_id == "b" and choice.free_slots == 3


def test_no_warm_server_for_another_model_a_full_one_or_another_context() -> None:
    rows = {
        "a": row("a", runtime_of(plan("a", sha="cd" * 32))),
        "b": row("b", runtime_of(plan("b")), jobs=4, state="BUSY"),
        "c": row("c", runtime_of(plan("c", context=4096))),
    }
    assert warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048) is None


def test_busy_servers_are_listed_only_when_asked_for() -> None:
    """The admission queue asks which busy server holds a waiting prompt: a full server (its
    node BUSY) is listed with no free slot; a draining or offline one never is."""
    draining = row("c", runtime_of(plan("c")), jobs=1)
    draining["drain_requested"] = True
    rows = {
        "a": row("a", runtime_of(plan("a")), jobs=4, state="BUSY"),
        "b": row("b", runtime_of(plan("b")), jobs=1),
        "c": draining,
        "d": row("d", runtime_of(plan("d")), state="OFFLINE"),
    }
    found = warm_choices(rows, model_name="m", model_sha256=SHA, context_size=2048, busy=True)
    assert [(c.plan.primary.node_id, c.free_slots) for c in found] == [("b", 3), ("a", 0)]
    assert [c.running for c in found] == [1, 4]
    free = warm_choices(rows, model_name="m", model_sha256=SHA, context_size=2048)
    assert [c.plan.primary.node_id for c in free] == ["b"]


def test_a_server_serves_one_registered_name_of_its_file() -> None:
    # The same GGUF registered again (as an embedding model, say) is another server.
    rows = {"a": row("a", runtime_of(plan("a")))}
    assert warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048) is not None
    assert warm_choice(rows, model_name="m-embed", model_sha256=SHA, context_size=2048) is None


def test_a_split_server_is_warm_only_while_its_workers_still_serve_it() -> None:
    split = runtime_of(plan("p", "w"))
    rows = {"p": row("p", split, jobs=1), "w": row("w", split, jobs=1)}
    assert warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048) is not None
    # The worker was taken by another server meanwhile: the split is gone.
    rows["w"] = row("w", runtime_of(plan("w", "x")))
    assert warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048) is None
    rows["w"] = row("w", split)
    assert (
        warm_choice(
            rows, model_name="m", model_sha256=SHA, context_size=2048, exclude=frozenset("w")
        )
        is None
    )
    assert (
        warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048, reachable="p".__eq__)
        is None
    )


def test_ready_servers_come_before_degraded_ones() -> None:
    rows = {
        "a": row("a", runtime_of(plan("a")), state="DEGRADED"),
        "b": row("b", runtime_of(plan("b")), jobs=3),
    }
    choice = warm_choice(rows, model_name="m", model_sha256=SHA, context_size=2048)
    assert choice is not None and choice.plan.primary.node_id == "b" and not choice.degraded


# --- plan_placement: slots per server ---------------------------------------------------------


def needs(weights: int = 100 * MIB, kv: int = 1024) -> ModelNeeds:
    return ModelNeeds("m", SHA, "m.gguf", weights, 30, kv, 8192)


def candidate(
    node_id: str, mem: int, *, cap: int = 4, model: bool = True, warm: bool = False
) -> Candidate:
    return Candidate(node_id, node_id, "READY", "10.0.0.1", 50052, mem, cap, model, True, cap, warm)


def request() -> PlacementRequest:
    return PlacementRequest(
        needs(), 2048, DEFAULT_ALLOWED_PEER_CIDRS, headroom_fraction=0.0, overhead_bytes=0
    )


def slots_of(*candidates: Candidate) -> int:
    result = plan_placement(request(), candidates)
    assert result.plan is not None, result.no_capacity
    return result.plan.parallel


def test_a_plan_gets_as_many_slots_as_memory_holds_up_to_the_cap() -> None:
    # 100 MiB of weights + 2 MiB of KV cache per slot.
    assert slots_of(candidate("a", 105 * MIB)) == 2
    assert slots_of(candidate("a", 1 << 40)) == 4
    assert slots_of(candidate("a", 1 << 40, cap=6)) == 6


def test_a_cold_plan_avoids_displacing_a_warm_server() -> None:
    result = plan_placement(
        request(), [candidate("a", 1 << 30, warm=True), candidate("b", 1 << 29)]
    )
    assert result.plan is not None and result.plan.primary.node_id == "b"


def test_the_runtime_key_names_model_context_slots_nodes_and_split() -> None:
    base = plan("p", "w")
    assert base.runtime_key == plan("p", "w").runtime_key
    for other in (plan("p", "w", parallel=2), plan("w", "p"), plan("p", "w", context=4096)):
        assert other.runtime_key != base.runtime_key
    assert ExecutionPlan.from_dict(base.to_dict()) == base
