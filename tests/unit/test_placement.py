"""Scheduler and split planner (domain/placement.py): example rules and properties."""

from __future__ import annotations

import inspect
import itertools
import json
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.placement import (
    GIB,
    INSUFFICIENT_MEMORY,
    MIB,
    MODEL_NOT_PRESENT,
    NO_ELIGIBLE_NODES,
    NODE_LIMIT,
    SPLIT_RESOLUTION,
    Candidate,
    ExecutionPlan,
    ModelNeeds,
    PlacementRequest,
    PlacementResult,
    PlanNode,
    address_allowed,
    required_bytes,
)
from domain.split_planner import plan_placement, split_units
from tests.unit.placement_builders import candidate, exact_request, weights_only

SHA = "ab" * 32

NEEDS = weights_only("smollm2-135m", SHA, "smollm2.gguf", 10 * GIB, 30)


def req(
    weights: int = 10 * GIB,
    *,
    max_nodes: int = 8,
    exclude: frozenset[str] = frozenset(),
    cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS,
    layers: int = 30,
) -> PlacementRequest:
    """A request whose required bytes are exactly ``weights`` (no headroom, no overhead)."""
    needs = weights_only("smollm2-135m", SHA, "smollm2.gguf", weights, layers)
    return exact_request(
        needs, context_size=2048, max_nodes=max_nodes, exclude=exclude, cidrs=cidrs
    )


#: A candidate node: its id and usable memory, the rest as asked.
cand = candidate


def ids(result: PlacementResult) -> tuple[str, ...]:
    assert result.plan is not None, result.no_capacity
    return result.plan.node_ids


def check_plan_invariants(
    request: PlacementRequest, candidates: list[Candidate], result: PlacementResult
) -> None:
    """Everything that must hold for any plan."""
    plan = result.plan
    assert plan is not None
    by_id = {c.node_id: c for c in candidates}
    required = request.required_bytes
    assert plan.required_bytes == required
    assert plan.context_size == request.context_size
    assert plan.model_sha256 == request.needs.sha256
    assert len(plan.tensor_split) == len(plan.nodes)
    assert len(set(plan.node_ids)) == len(plan.node_ids)
    assert 1 <= len(plan.nodes) <= min(request.max_nodes, request.needs.layers)
    units = [round(f * SPLIT_RESOLUTION) for f in plan.tensor_split]
    assert sum(units) == SPLIT_RESOLUTION
    assert all(u / SPLIT_RESOLUTION == f for u, f in zip(units, plan.tensor_split, strict=True))
    assert math.fsum(plan.tensor_split) == pytest.approx(1.0, abs=1e-9)
    assert sum(n.assigned_bytes for n in plan.nodes) >= required
    assert by_id[plan.primary.node_id].has_model
    for node, fraction in zip(plan.nodes, plan.tensor_split, strict=True):
        c = by_id[node.node_id]
        assert node.address == c.address and node.rpc_port == c.rpc_port
        share = Fraction(round(fraction * SPLIT_RESOLUTION), SPLIT_RESOLUTION) * required
        assert node.assigned_bytes == math.ceil(share)
        # the core safety rule: never more than the node can hold
        assert share <= c.usable_memory_bytes
        assert node.assigned_bytes <= c.usable_memory_bytes
        assert c.state in ("READY", "DEGRADED") and c.free_slots > 0 and c.heartbeat_fresh
        assert c.node_id not in request.exclude
        assert address_allowed(c.address, request.allowed_peer_cidrs)
        if not result.fallback_used:
            assert c.state == "READY"
    workers = [by_id[w.node_id] for w in plan.workers]
    assert workers == sorted(workers, key=lambda c: (-c.usable_memory_bytes, c.node_id))


# ---------------------------------------------------------------------------------------------
# required bytes and addresses


def test_required_bytes_formula() -> None:
    needs = ModelNeeds("m", SHA, "m.gguf", 1000 * MIB, 24, 4096, 4096)
    base = 1000 * MIB + 4096 * 2048
    assert required_bytes(needs, 2048) == math.ceil(base * 1.10) + 64 * MIB
    assert required_bytes(needs, 2048, headroom_fraction=0.0, overhead_bytes=0) == base
    assert required_bytes(needs, 2048, headroom_fraction=0.5, overhead_bytes=7) == (
        math.ceil(base * 1.5) + 7
    )
    assert required_bytes(needs, 4096) > required_bytes(needs, 2048)


@pytest.mark.parametrize(
    ("context", "headroom", "overhead"), [(0, 0.1, 0), (10, -0.1, 0), (10, 0.1, -1)]
)
def test_required_bytes_rejects_bad_arguments(context: int, headroom: float, overhead: int) -> None:
    with pytest.raises(ValueError):
        required_bytes(NEEDS, context, headroom, overhead)


def test_model_needs_validation() -> None:
    with pytest.raises(ValueError):
        ModelNeeds("m", SHA, "m.gguf", 0, 24, 0, 4096)
    with pytest.raises(ValueError):
        ModelNeeds("m", SHA, "m.gguf", 10, 0, 0, 4096)
    with pytest.raises(ValueError):
        ModelNeeds("", SHA, "m.gguf", 10, 1, 0, 4096)


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        PlacementRequest(NEEDS, NEEDS.context_length_max + 1, DEFAULT_ALLOWED_PEER_CIDRS)
    with pytest.raises(ValueError):
        PlacementRequest(NEEDS, 0, DEFAULT_ALLOWED_PEER_CIDRS)
    with pytest.raises(ValueError):
        PlacementRequest(NEEDS, 512, DEFAULT_ALLOWED_PEER_CIDRS, max_nodes=0)
    with pytest.raises(ValueError):
        PlacementRequest(NEEDS, context_size=512, allowed_peer_cidrs=())
    with pytest.raises(ValueError, match="invalid CIDR"):
        PlacementRequest(NEEDS, context_size=512, allowed_peer_cidrs=("10.0.0.0/33",))
    coerced = PlacementRequest(
        NEEDS,
        context_size=512,
        allowed_peer_cidrs=["10.0.0.0/8"],  # type: ignore[arg-type]
        exclude={"a"},  # type: ignore[arg-type]
    )
    assert coerced.allowed_peer_cidrs == ("10.0.0.0/8",)
    assert coerced.exclude == frozenset({"a"})
    hash(coerced)
    ok = PlacementRequest(NEEDS, 512, ("10.1.0.0/16",))
    assert ok.required_bytes == required_bytes(NEEDS, 512)
    assert ok.allowed_peer_cidrs == ("10.1.0.0/16",)


def test_the_allowed_networks_are_the_callers_not_a_default() -> None:
    """Placement has no peer networks of its own: the controller's ALLOWED_PEER_CIDRS are
    passed down to every request and address check."""
    empty = inspect.Parameter.empty
    assert inspect.signature(PlacementRequest).parameters["allowed_peer_cidrs"].default is empty
    assert inspect.signature(address_allowed).parameters["cidrs"].default is empty


@pytest.mark.parametrize(
    "address",
    [
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.254",
        "192.168.1.20",
        "127.0.0.1",
        "::1",
        "fd12:3456:789a::1",
        "fc00::1",
        "::ffff:192.168.1.5",
    ],
)
def test_default_cidrs_allow_private_addresses(address: str) -> None:
    assert address_allowed(address, DEFAULT_ALLOWED_PEER_CIDRS)


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "172.32.0.1",
        "172.15.255.255",
        "11.0.0.1",
        "2001:4860:4860::8888",
        "fe80::1",
        "0.0.0.0",
        "::ffff:8.8.8.8",
        "",
        "gpu-box.local",
        "10.0.0.1:50052",
        "10.0.0.256",
    ],
)
def test_default_cidrs_refuse_public_or_invalid_addresses(address: str) -> None:
    assert not address_allowed(address, DEFAULT_ALLOWED_PEER_CIDRS)


def test_address_allowed_custom_cidrs_and_bad_cidr() -> None:
    assert address_allowed("8.8.8.8", ("8.8.8.0/24",))
    assert not address_allowed("10.0.0.1", ("8.8.8.0/24",))
    assert address_allowed("10.0.0.7", ("10.0.0.1/24",))  # host bits tolerated
    with pytest.raises(ValueError):
        address_allowed("10.0.0.1", ("not-a-cidr",))


# ---------------------------------------------------------------------------------------------
# eligibility


@pytest.mark.parametrize(
    "bad",
    [
        {"state": "BUSY"},
        {"state": "OFFLINE"},
        {"state": "DRAINING"},
        {"state": "ERROR"},
        {"state": "UNINITIALIZED"},
        {"state": "REGISTERING"},
        {"free_slots": 0},
        {"free_slots": -1},
        {"fresh": False},
        {"rpc_port": 0},
    ],
)
def test_ineligible_candidates_are_ignored(bad: dict[str, object]) -> None:
    big = cand("a", 100 * GIB, has_model=True, **bad)  # type: ignore[arg-type]
    small = cand("b", 12 * GIB, has_model=True)
    result = plan_placement(req(), [big, small])
    assert ids(result) == ("b",)
    assert result.violations == ()


def test_excluded_nodes_are_ignored() -> None:
    a = cand("a", 100 * GIB, has_model=True)
    b = cand("b", 12 * GIB, has_model=True)
    assert ids(plan_placement(req(), [a, b])) == ("a",)
    assert ids(plan_placement(req(exclude=frozenset({"a"})), [a, b])) == ("b",)


def test_no_candidates_at_all() -> None:
    result = plan_placement(req(), [])
    assert result.plan is None and result.no_capacity is not None
    assert result.no_capacity.code == NO_ELIGIBLE_NODES
    assert "no eligible node" in result.no_capacity.reason


def test_only_ineligible_candidates() -> None:
    result = plan_placement(req(), [cand("a", 100 * GIB, has_model=True, state="OFFLINE")])
    assert result.no_capacity is not None
    assert result.no_capacity.code == NO_ELIGIBLE_NODES
    assert not result.ok


def test_duplicate_node_ids_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        plan_placement(req(), [cand("a", GIB), cand("a", 2 * GIB)])


# ---------------------------------------------------------------------------------------------
# security: peer addresses


def test_public_address_is_a_violation_and_excluded() -> None:
    public = cand("pub", 100 * GIB, has_model=True, address="8.8.8.8")
    private = cand("priv", 12 * GIB, has_model=True, address="192.168.1.10")
    result = plan_placement(req(), [public, private])
    assert ids(result) == ("priv",)
    assert len(result.violations) == 1
    v = result.violations[0]
    assert (v.node_id, v.address) == ("pub", "8.8.8.8")
    assert "outside the allowed peer networks" in v.reason


def test_public_worker_is_never_used_even_if_needed() -> None:
    primary = cand("p", 6 * GIB, has_model=True, address="10.0.0.1")
    public = cand("w", 6 * GIB, address="8.8.8.8")
    result = plan_placement(req(), [primary, public])
    assert result.plan is None
    assert result.no_capacity is not None and result.no_capacity.code == INSUFFICIENT_MEMORY
    assert [v.node_id for v in result.violations] == ["w"]


def test_invalid_address_is_a_violation() -> None:
    result = plan_placement(req(), [cand("h", 100 * GIB, has_model=True, address="gpu-box.local")])
    assert result.plan is None
    assert [v.node_id for v in result.violations] == ["h"]
    assert "not an IP address" in result.violations[0].reason


def test_violations_only_for_otherwise_eligible_nodes_and_sorted() -> None:
    cands = [
        cand("z", GIB, address="8.8.4.4"),
        cand("y", GIB, address="1.1.1.1", state="OFFLINE"),
        cand("x", GIB, address="9.9.9.9"),
        cand("w", 20 * GIB, has_model=True, address="10.9.9.9"),
    ]
    result = plan_placement(req(exclude=frozenset({"x"})), cands)
    assert ids(result) == ("w",)
    assert [v.node_id for v in result.violations] == ["z"]


def test_custom_allowed_cidrs() -> None:
    a = cand("a", 20 * GIB, has_model=True, address="10.0.0.5")
    b = cand("b", 20 * GIB, has_model=True, address="192.168.0.5")
    result = plan_placement(req(cidrs=("192.168.0.0/24",)), [a, b])
    assert ids(result) == ("b",)
    assert [v.node_id for v in result.violations] == ["a"]


# ---------------------------------------------------------------------------------------------
# single node


def test_single_node_preferred_when_it_fits() -> None:
    cands = [
        cand("a", 11 * GIB, has_model=True),
        cand("b", 30 * GIB),  # larger, but without the file
        cand("c", 20 * GIB),
    ]
    result = plan_placement(req(), cands)
    assert ids(result) == ("a",)
    plan = result.plan
    assert plan is not None
    assert plan.workers == ()
    assert plan.tensor_split == (1.0,)
    assert plan.primary.assigned_bytes == 10 * GIB
    assert not result.fallback_used
    check_plan_invariants(req(), cands, result)


def test_single_node_choice_most_memory_then_node_id() -> None:
    cands = [
        cand("b", 20 * GIB, has_model=True),
        cand("a", 20 * GIB, has_model=True),
        cand("c", 15 * GIB, has_model=True),
    ]
    assert ids(plan_placement(req(), cands)) == ("a",)
    cands.append(cand("d", 21 * GIB, has_model=True))
    assert ids(plan_placement(req(), cands)) == ("d",)


def test_exact_fit_single_node() -> None:
    assert ids(plan_placement(req(), [cand("a", 10 * GIB, has_model=True)])) == ("a",)
    result = plan_placement(req(), [cand("a", 10 * GIB - 1, has_model=True)])
    assert result.plan is None


def test_plan_fields_carry_model_and_context() -> None:
    request = PlacementRequest(NEEDS, 4096, DEFAULT_ALLOWED_PEER_CIDRS)
    result = plan_placement(request, [cand("a", 64 * GIB, has_model=True)])
    plan = result.plan
    assert plan is not None
    assert (plan.model_name, plan.model_sha256, plan.model_file_name) == (
        NEEDS.name,
        NEEDS.sha256,
        NEEDS.file_name,
    )
    assert plan.context_size == 4096
    assert plan.required_bytes == required_bytes(NEEDS, 4096)
    assert plan.primary.rpc_port == 50052
    assert plan.assigned_bytes == {"a": required_bytes(NEEDS, 4096)}


# ---------------------------------------------------------------------------------------------
# multi node


def test_split_over_two_nodes_proportional_to_memory() -> None:
    cands = [cand("p", 6 * GIB, has_model=True), cand("w", 12 * GIB)]
    request = req()
    result = plan_placement(request, cands)
    assert ids(result) == ("p", "w")
    plan = result.plan
    assert plan is not None
    assert plan.tensor_split == pytest.approx((1 / 3, 2 / 3), abs=1e-6)
    check_plan_invariants(request, cands, result)


def test_primary_must_hold_file_workers_need_not() -> None:
    cands = [cand("small", 2 * GIB, has_model=True), cand("big1", 5 * GIB), cand("big2", 5 * GIB)]
    result = plan_placement(req(), cands)
    assert ids(result) == ("small", "big1", "big2")
    check_plan_invariants(req(), cands, result)


def test_fewest_nodes_chooses_largest_workers() -> None:
    cands = [
        cand("p", 4 * GIB, has_model=True),
        cand("w1", 1 * GIB),
        cand("w2", 1 * GIB),
        cand("w3", 1 * GIB),
        cand("w4", 7 * GIB),
        cand("w5", 1 * GIB),
    ]
    result = plan_placement(req(), cands)
    assert ids(result) == ("p", "w4")


def test_primary_choice_minimises_node_count() -> None:
    # the largest node has no file, so the small file holder is the primary and the big node its
    # only worker: two nodes, not three
    cands = [
        cand("p", 9 * GIB),
        cand("q", 2 * GIB, has_model=True),
        cand("r", 9 * GIB),
    ]
    result = plan_placement(req(weights=10 * GIB), cands)
    assert ids(result) == ("q", "p")
    # a second file holder can be a worker; the larger holder is the primary
    cands = [
        cand("big", 8 * GIB, has_model=True),
        cand("mid", 6 * GIB, has_model=True),
        cand("w1", 4 * GIB),
        cand("w2", 4 * GIB),
    ]
    assert ids(plan_placement(req(weights=13 * GIB), cands)) == ("big", "mid")
    assert ids(plan_placement(req(weights=15 * GIB), cands)) == ("big", "mid", "w1")
    # among file holders needing the same node count, the larger is the primary
    cands = [cand("p", 9 * GIB, has_model=True), cand("q", 1 * GIB, has_model=True)]
    assert ids(plan_placement(req(), cands)) == ("p", "q")


def test_primary_tie_break_by_memory_then_id() -> None:
    cands = [
        cand("b", 5 * GIB, has_model=True),
        cand("a", 5 * GIB, has_model=True),
        cand("c", 6 * GIB),
    ]
    # two nodes needed; either file holder with "c" works; equal memory -> "a"
    assert ids(plan_placement(req(), cands)) == ("a", "c")


def test_workers_ordered_by_memory_then_id() -> None:
    cands = [
        cand("p", 1 * GIB, has_model=True),
        cand("d", 3 * GIB),
        cand("c", 3 * GIB),
        cand("e", 4 * GIB),
    ]
    result = plan_placement(req(), cands)
    assert ids(result) == ("p", "e", "c", "d")
    check_plan_invariants(req(), cands, result)


def test_max_nodes_bounds_the_plan() -> None:
    cands = [cand("p", 2 * GIB, has_model=True)] + [cand(f"w{i}", 2 * GIB) for i in range(5)]
    assert len(ids(plan_placement(req(max_nodes=5), cands))) == 5
    result = plan_placement(req(max_nodes=4), cands)
    assert result.plan is None
    assert result.no_capacity is not None
    assert result.no_capacity.code == NODE_LIMIT
    assert "at most 4 node(s)" in result.no_capacity.reason


def test_layer_count_bounds_the_plan() -> None:
    cands = [cand("p", 2 * GIB, has_model=True)] + [cand(f"w{i}", 2 * GIB) for i in range(5)]
    result = plan_placement(req(layers=3), cands)
    assert result.no_capacity is not None and result.no_capacity.code == NODE_LIMIT


def test_no_primary_holds_file() -> None:
    result = plan_placement(req(), [cand("a", 100 * GIB), cand("b", 100 * GIB)])
    assert result.plan is None
    assert result.no_capacity is not None
    assert result.no_capacity.code == MODEL_NOT_PRESENT
    assert result.no_capacity.reason == f"no eligible node holds model smollm2-135m (sha256 {SHA})"


def test_file_only_on_ineligible_node() -> None:
    cands = [cand("a", 100 * GIB, has_model=True, state="BUSY"), cand("b", 100 * GIB)]
    result = plan_placement(req(), cands)
    assert result.no_capacity is not None and result.no_capacity.code == MODEL_NOT_PRESENT


def test_insufficient_memory_reports_needed_and_available() -> None:
    cands = [cand("p", 3 * GIB, has_model=True), cand("w", 4 * GIB)]
    result = plan_placement(req(), cands)
    nc = result.no_capacity
    assert nc is not None
    assert nc.code == INSUFFICIENT_MEMORY
    assert nc.needed_bytes == 10 * GIB
    assert nc.available_bytes == 7 * GIB
    assert "10.00 GiB" in nc.reason and "7.00 GiB" in nc.reason
    assert "smollm2-135m" in nc.reason


def test_split_quantisation_needs_a_few_bytes_of_slack() -> None:
    # three equal nodes summing exactly to the requirement cannot take 1/3 each in millionths
    # without one exceeding its memory; two bytes of slack per node are enough
    request = req(weights=3_000_000)
    exact = [cand("p", 1_000_000, has_model=True), cand("w1", 1_000_000), cand("w2", 1_000_000)]
    refused = plan_placement(request, exact)
    assert refused.no_capacity is not None
    assert refused.no_capacity.code == INSUFFICIENT_MEMORY
    assert "rounding" in refused.no_capacity.reason
    slack = [cand("p", 1_000_002, has_model=True), cand("w1", 1_000_002), cand("w2", 1_000_002)]
    result = plan_placement(request, slack)
    check_plan_invariants(request, slack, result)
    assert result.plan is not None
    assert result.plan.tensor_split == (0.333334, 0.333333, 0.333333)


def test_split_adjusted_when_proportional_rounding_would_exceed() -> None:
    # proportional largest remainder would give the 500-byte node one millionth, i.e. 953 bytes
    required = 952_380_952
    assert split_units([500, 999_999_500], required) == (0, SPLIT_RESOLUTION)
    request = req(weights=required)
    cands = [cand("p", 500, has_model=True), cand("w", 999_999_500)]
    result = plan_placement(request, cands)
    check_plan_invariants(request, cands, result)
    assert ids(result) == ("p", "w")


def test_split_units_rejects_impossible_inputs() -> None:
    with pytest.raises(ValueError):
        split_units([1, 1], 1_000_000)
    with pytest.raises(ValueError):
        split_units([], 10)
    with pytest.raises(ValueError):
        split_units([0, 10], 10)


# ---------------------------------------------------------------------------------------------
# DEGRADED fallback


def test_degraded_not_used_when_ready_suffices() -> None:
    cands = [
        cand("deg", 100 * GIB, has_model=True, state="DEGRADED"),
        cand("r1", 6 * GIB, has_model=True),
        cand("r2", 6 * GIB),
    ]
    result = plan_placement(req(), cands)
    assert ids(result) == ("r1", "r2")
    assert not result.fallback_used


def test_degraded_used_as_fallback() -> None:
    cands = [cand("deg", 100 * GIB, has_model=True, state="DEGRADED"), cand("r1", 6 * GIB)]
    result = plan_placement(req(), cands)
    assert ids(result) == ("deg",)
    assert result.fallback_used
    check_plan_invariants(req(), cands, result)


def test_degraded_worker_fallback_keeps_ready_primary() -> None:
    cands = [
        cand("r1", 6 * GIB, has_model=True),
        cand("d1", 6 * GIB, has_model=True, state="DEGRADED"),
        cand("r2", 3 * GIB),
    ]
    result = plan_placement(req(), cands)
    # two nodes are needed and one must be DEGRADED; the READY node is the primary
    assert ids(result) == ("r1", "d1")
    assert result.fallback_used


def test_fallback_minimises_degraded_nodes() -> None:
    cands = [
        cand("p", 5 * GIB, has_model=True),
        cand("d1", 5 * GIB, state="DEGRADED"),
        cand("d2", 5 * GIB, state="DEGRADED"),
        cand("r", 3 * GIB),
    ]
    # READY only: 8 GiB < 10 GiB; with fallback, {p, d1} is the fewest nodes (2)
    result = plan_placement(req(), cands)
    assert ids(result) == ("p", "d1")
    assert result.fallback_used
    # with 12 GiB needed three nodes are needed; {p, d1, r} uses fewer DEGRADED than {p, d1, d2}
    result = plan_placement(req(weights=12 * GIB), cands)
    assert ids(result) == ("p", "d1", "r")


def test_fallback_failure_reports_no_capacity_without_fallback_flag() -> None:
    cands = [cand("d", 2 * GIB, has_model=True, state="DEGRADED"), cand("r", 2 * GIB)]
    result = plan_placement(req(), cands)
    assert result.plan is None
    assert not result.fallback_used
    assert result.no_capacity is not None and result.no_capacity.available_bytes == 4 * GIB


# ---------------------------------------------------------------------------------------------
# determinism and serialisation


def test_same_result_for_any_candidate_order() -> None:
    cands = [
        cand("p", 4 * GIB, has_model=True),
        cand("q", 4 * GIB, has_model=True),
        cand("w1", 3 * GIB),
        cand("w2", 3 * GIB),
        cand("w3", 3 * GIB, address="8.8.8.8"),
    ]
    results = {plan_placement(req(), perm) for perm in itertools.permutations(cands)}
    assert len(results) == 1


def test_plan_dict_round_trip_is_json_safe() -> None:
    cands = [cand("p", 4 * GIB, has_model=True), cand("w1", 3 * GIB), cand("w2", 5 * GIB)]
    plan = plan_placement(req(), cands).plan
    assert plan is not None
    data = plan.to_dict()
    text = json.dumps(data)
    back = ExecutionPlan.from_dict(json.loads(text))
    assert back == plan
    assert isinstance(data["workers"], list) and isinstance(data["tensor_split"], list)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("primary"),
        lambda d: d.__setitem__("context_size", "2048"),
        lambda d: d.__setitem__("context_size", True),
        lambda d: d.__setitem__("tensor_split", [0.5]),
        lambda d: d.__setitem__("tensor_split", [0.5, 0.6]),
        lambda d: d.__setitem__("tensor_split", ["0.5", "0.5"]),
        lambda d: d.__setitem__("workers", ["w"]),
        lambda d: d["primary"].pop("node_id"),
    ],
)
def test_plan_from_dict_rejects_malformed(mutate: object) -> None:
    plan = ExecutionPlan(
        model_name="m",
        model_sha256=SHA,
        model_file_name="m.gguf",
        context_size=2048,
        required_bytes=100,
        primary=PlanNode("p", "10.0.0.1", 50052, 50),
        workers=(PlanNode("w", "10.0.0.2", 50052, 50),),
        tensor_split=(0.5, 0.5),
    )
    data = json.loads(json.dumps(plan.to_dict()))
    mutate(data)  # type: ignore[operator]
    with pytest.raises(ValueError):
        ExecutionPlan.from_dict(data)


def test_result_requires_exactly_one_outcome() -> None:
    with pytest.raises(ValueError):
        PlacementResult(plan=None)


# ---------------------------------------------------------------------------------------------
# properties

NODE_IDS = [f"n{i}" for i in range(7)]


#: What the property tests draw: a placement request and the candidate nodes.
Scenario = tuple[PlacementRequest, list[Candidate]]


@st.composite
def _scenario(draw: st.DrawFn, healthy: bool) -> Scenario:
    """Random candidates; ``healthy`` ones are all eligible (READY or DEGRADED, private)."""
    count = draw(st.integers(min_value=0, max_value=6) | st.integers(min_value=2, max_value=6))
    node_ids = draw(st.permutations(NODE_IDS))[:count]
    unit = draw(st.sampled_from([1, 7, 1_000_003, GIB]))
    states = ["READY"] * 5 + ["DEGRADED"] * 2 + ([] if healthy else ["BUSY", "OFFLINE"])
    cands: list[Candidate] = []
    for i, node_id in enumerate(node_ids):
        public = not healthy and draw(st.sampled_from([False] * 7 + [True]))
        present = healthy or draw(st.sampled_from([True] * 9 + [False]))
        cands.append(
            Candidate(
                node_id=node_id,
                name=f"host-{node_id}",
                state=draw(st.sampled_from(states)),
                address="8.8.8.8" if public else f"10.0.0.{i + 1}",
                rpc_port=50052,
                usable_memory_bytes=int(present)
                * draw(st.integers(min_value=1, max_value=20))
                * unit
                + draw(st.integers(min_value=0, max_value=3)),
                free_slots=1 if healthy else draw(st.sampled_from([1, 1, 1, 1, 2, 0])),
                has_model=i == 0 or draw(st.sampled_from([True, False, False])),
                heartbeat_fresh=healthy or draw(st.sampled_from([True] * 5 + [False])),
            )
        )
    tight = draw(st.booleans())
    if cands and tight:
        # near the memory of a few of the nodes: tight, multi-node fits
        some = draw(st.lists(st.sampled_from(cands), min_size=1, max_size=len(cands), unique=True))
        jitter = draw(st.integers(min_value=-3, max_value=3)) * max(1, unit // 4)
        weights = max(1, sum(c.usable_memory_bytes for c in some) + jitter)
    else:
        weights = draw(st.integers(min_value=1, max_value=60)) * unit + draw(
            st.integers(min_value=0, max_value=5)
        )
    exclude = (
        frozenset() if healthy else frozenset(draw(st.lists(st.sampled_from(NODE_IDS), max_size=1)))
    )
    request = req(
        weights=weights,
        max_nodes=draw(st.sampled_from([8, 6, 4, 3, 2, 1])),
        exclude=exclude,
        layers=draw(st.sampled_from([30, 4, 2])),
    )
    return request, cands


def scenarios() -> st.SearchStrategy[Scenario]:
    return _scenario(healthy=False) | _scenario(healthy=True)


def _eligible(request: PlacementRequest, c: Candidate) -> bool:
    return (
        c.state in ("READY", "DEGRADED")
        and c.free_slots > 0
        and c.heartbeat_fresh
        and c.usable_memory_bytes > 0
        and c.node_id not in request.exclude
        and address_allowed(c.address, request.allowed_peer_cidrs)
    )


def _brute_fits(nodes: tuple[Candidate, ...], required: int) -> bool:
    """Independent restatement: a capped split in 1/SPLIT_RESOLUTION units exists."""
    if not any(c.has_model for c in nodes):
        return False
    room = sum(
        min(SPLIT_RESOLUTION, c.usable_memory_bytes * SPLIT_RESOLUTION // required) for c in nodes
    )
    return room >= SPLIT_RESOLUTION


def _brute_best(request: PlacementRequest, pool: list[Candidate]) -> tuple[int, int] | None:
    """(fewest nodes, fewest DEGRADED among those) by exhaustive search, or None."""
    limit = min(request.max_nodes, request.needs.layers)
    required = request.required_bytes
    for k in range(1, min(limit, len(pool)) + 1):
        degraded = [
            sum(c.state == "DEGRADED" for c in subset)
            for subset in itertools.combinations(pool, k)
            if _brute_fits(subset, required)
        ]
        if degraded:
            return k, min(degraded)
    return None


PROPERTY_SETTINGS = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_plan_invariants_and_never_over_memory(scenario: Scenario) -> None:
    request, cands = scenario
    result = plan_placement(request, cands)
    if result.plan is not None:
        assert result.no_capacity is None
        check_plan_invariants(request, cands, result)
    else:
        assert result.no_capacity is not None and result.no_capacity.reason
        assert not result.fallback_used


@PROPERTY_SETTINGS
@given(scenarios(), st.randoms(use_true_random=False))
def test_property_deterministic_under_permutation(scenario: Scenario, rnd: object) -> None:
    request, cands = scenario
    shuffled = list(cands)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert plan_placement(request, cands) == plan_placement(request, shuffled)
    assert plan_placement(request, list(reversed(cands))) == plan_placement(request, cands)


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_single_ready_node_with_file_wins(scenario: Scenario) -> None:
    request, cands = scenario
    singles = [
        c
        for c in cands
        if _eligible(request, c)
        and c.state == "READY"
        and c.has_model
        and c.usable_memory_bytes >= request.required_bytes
    ]
    result = plan_placement(request, cands)
    if singles:
        best = min(singles, key=lambda c: (-c.usable_memory_bytes, c.node_id))
        assert ids(result) == (best.node_id,)
        assert not result.fallback_used


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_node_count_minimal_and_degraded_only_as_fallback(scenario: Scenario) -> None:
    request, cands = scenario
    pool = [c for c in cands if _eligible(request, c)]
    ready_best = _brute_best(request, [c for c in pool if c.state == "READY"])
    all_best = _brute_best(request, pool)
    result = plan_placement(request, cands)
    by_id = {c.node_id: c for c in cands}
    if ready_best is not None:
        assert not result.fallback_used
        assert len(ids(result)) == ready_best[0]
    elif all_best is not None:
        assert result.fallback_used
        chosen = [by_id[i] for i in ids(result)]
        assert len(chosen) == all_best[0]
        assert sum(c.state == "DEGRADED" for c in chosen) == all_best[1]
    else:
        assert result.plan is None


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_public_addresses_reported_never_used(scenario: Scenario) -> None:
    request, cands = scenario
    result = plan_placement(request, cands)
    expected = sorted(
        c.node_id
        for c in cands
        if c.address == "8.8.8.8"
        and c.state in ("READY", "DEGRADED")
        and c.free_slots > 0
        and c.heartbeat_fresh
        and c.usable_memory_bytes > 0
        and c.node_id not in request.exclude
    )
    assert [v.node_id for v in result.violations] == expected
    assert all(v.address == "8.8.8.8" for v in result.violations)
    if result.plan is not None:
        assert all(n.address != "8.8.8.8" for n in result.plan.nodes)


@PROPERTY_SETTINGS
@given(scenarios())
def test_property_plan_survives_dict_round_trip(scenario: Scenario) -> None:
    request, cands = scenario
    plan = plan_placement(request, cands).plan
    if plan is not None:
        assert ExecutionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=10**13), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=10**13),
)
def test_property_split_units_capped_and_complete(usables: list[int], required: int) -> None:
    caps = [min(SPLIT_RESOLUTION, u * SPLIT_RESOLUTION // required) for u in usables]
    if sum(caps) < SPLIT_RESOLUTION:
        with pytest.raises(ValueError):
            split_units(usables, required)
        return
    units = split_units(usables, required)
    assert sum(units) == SPLIT_RESOLUTION
    total = sum(usables)
    for u, mem in zip(units, usables, strict=True):
        assert mem * SPLIT_RESOLUTION // total <= u
        assert -(-u * required // SPLIT_RESOLUTION) <= mem
        # proportional up to rounding, unless a cap forced a node below its share
        assert u <= mem * SPLIT_RESOLUTION // total + len(usables)
