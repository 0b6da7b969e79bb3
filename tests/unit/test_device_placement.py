"""Device-aware split plans (domain/split_planner.py): GPU inventories as fakes, example plans
for the cases operators meet, and properties over random mixed inventories: no device is ever
given more than it has, the first tier of preference that can hold the model is the one used,
with no more nodes than that tier needs, and a split never mixes RPC protocols."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.placement import (
    DEVICE_GPU,
    GIB,
    HOST_DEVICE,
    MIB,
    RPC_VERSION_MISMATCH,
    SPLIT_RESOLUTION,
    TIER_CPU,
    TIER_CPU_OVER_RPC,
    TIER_GPUS_AND_HOST,
    TIER_GPUS_OVER_RPC,
    TIER_ONE_DEVICE,
    TIER_ONE_NODE_GPUS,
    TIERS,
    Candidate,
    Device,
    ExecutionPlan,
    ModelNeeds,
    PlacementRequest,
    PlacementResult,
    required_bytes,
)
from domain.split_planner import plan_placement
from tests.unit.placement_builders import candidate, exact_request, weights_only

SHA = "cd" * 32
RES = SPLIT_RESOLUTION
RESERVE = 512 * MIB


def request(
    weights: int, *, layers: int = 32, max_nodes: int = 8, reserve: int = RESERVE
) -> PlacementRequest:
    """Required bytes are exactly ``weights`` (no KV cache, headroom or overhead)."""
    needs = weights_only("llama-70b", SHA, "llama.gguf", weights, layers)
    return exact_request(needs, context_size=4096, max_nodes=max_nodes, reserve=reserve)


def node(
    node_id: str,
    *gpus: int,
    ram: int = 64 * GIB,
    model: bool = False,
    protocol: str = "7.0.0",
    state: str = "READY",
    slots: int = 1,
) -> Candidate:
    """A node with a fake GPU of each size in ``gpus`` (``CUDA0``, ``CUDA1``, ...)."""
    return candidate(
        node_id,
        ram,
        state=state,
        has_model=model,
        slot_cap=slots,
        devices=tuple(
            Device(f"CUDA{i}", b, f"Fake GPU {i}", DEVICE_GPU) for i, b in enumerate(gpus)
        ),
        rpc_protocol=protocol,
    )


def devices_of(result: PlacementResult) -> list[tuple[str, str, bool]]:
    assert result.plan is not None, result.no_capacity
    return [(d.node_id, d.device, d.via_rpc) for d in result.plan.devices]


# ---------------------------------------------------------------------------------------------
# examples


def test_one_gpu_that_holds_the_model_is_one_device() -> None:
    result = plan_placement(
        request(6 * GIB), [node("a", 24 * GIB, model=True), node("b", 80 * GIB)]
    )
    plan = result.plan
    assert plan is not None and plan.tier == TIER_ONE_DEVICE
    assert devices_of(result) == [("a", "CUDA0", False)]
    assert plan.workers == () and plan.n_gpu_layers is None
    assert plan.devices[0].assigned_bytes == 6 * GIB + RESERVE
    assert any("one GPU holds it" in r for r in plan.reasons)


def test_two_gpus_of_one_node_share_the_model_by_room() -> None:
    """A node with two cards is two devices; together they hold what neither holds alone."""
    result = plan_placement(request(30 * GIB), [node("a", 24 * GIB, 16 * GIB, model=True)])
    plan = result.plan
    assert plan is not None and plan.tier == TIER_ONE_NODE_GPUS
    assert devices_of(result) == [("a", "CUDA0", False), ("a", "CUDA1", False)]
    shares = [d.share for d in plan.devices]
    room = [24 * GIB - RESERVE, 16 * GIB - RESERVE]
    assert shares == pytest.approx([r / sum(room) for r in room], abs=1e-6)
    assert plan.devices[0].assigned_bytes <= 24 * GIB
    assert plan.devices[1].assigned_bytes <= 16 * GIB


def test_the_fewest_gpus_of_a_node_are_used() -> None:
    result = plan_placement(request(20 * GIB), [node("a", 8 * GIB, 16 * GIB, 16 * GIB, model=True)])
    assert [d for _, d, _ in devices_of(result)] == ["CUDA1", "CUDA2"]


def test_three_nodes_with_mixed_cards_split_over_rpc() -> None:
    """A 24 GiB and a 12 GiB card on the file's node, an 80 GiB card and a 8 GiB card elsewhere:
    110 GiB of weights take the primary's two cards and the big card over RPC, not the small."""
    nodes = [
        node("a", 24 * GIB, 12 * GIB, model=True),
        node("b", 80 * GIB),
        node("c", 8 * GIB),
    ]
    result = plan_placement(request(110 * GIB), nodes)
    plan = result.plan
    assert plan is not None and plan.tier == TIER_GPUS_OVER_RPC
    assert devices_of(result) == [
        ("a", "CUDA0", False),
        ("a", "CUDA1", False),
        ("b", "CUDA0", True),
    ]
    assert plan.node_ids == ("a", "b")
    assert plan.tensor_split == pytest.approx(
        [(plan.devices[0].share + plan.devices[1].share), plan.devices[2].share]
    )


def test_a_node_without_a_gpu_may_be_the_primary_of_a_gpu_split() -> None:
    """The file is on a CPU box too small for it; the layers go to a GPU box's card, over RPC."""
    nodes = [node("a", ram=8 * GIB, model=True), node("b", 24 * GIB)]
    result = plan_placement(request(20 * GIB), nodes)
    plan = result.plan
    assert plan is not None and plan.tier == TIER_GPUS_OVER_RPC
    assert devices_of(result) == [("b", "CUDA0", True)]
    assert plan.tensor_split == (0.0, 1.0)


def test_a_small_gpu_and_large_ram_keep_the_first_layers_in_host_memory() -> None:
    result = plan_placement(
        request(32 * GIB, layers=32), [node("a", 8 * GIB, ram=64 * GIB, model=True)]
    )
    plan = result.plan
    assert plan is not None and plan.tier == TIER_GPUS_AND_HOST
    assert devices_of(result) == [("a", "CUDA0", False)]
    # 7.5 GiB of room hold 7 of the 32 one-GiB layers; the other 25 stay in RAM.
    assert plan.n_gpu_layers == 7
    assert plan.devices[0].assigned_bytes == 7 * GIB + RESERVE
    assert plan.primary.assigned_bytes == 32 * GIB + RESERVE


def test_gpus_and_host_memory_come_before_gpus_over_rpc() -> None:
    nodes = [node("a", 8 * GIB, ram=64 * GIB, model=True), node("b", 40 * GIB)]
    plan = plan_placement(request(32 * GIB), nodes).plan
    assert plan is not None and plan.tier == TIER_GPUS_AND_HOST


def test_cpu_only_when_no_gpu_plan_fits_and_the_gpu_node_keeps_its_gpu_out() -> None:
    """GPUs too small for even a layer: host memory only, with no layer on the GPU."""
    result = plan_placement(request(32 * GIB), [node("a", 600 * MIB, ram=64 * GIB, model=True)])
    plan = result.plan
    assert plan is not None and plan.tier == TIER_CPU
    assert plan.devices == () and plan.n_gpu_layers == 0


def test_a_cpu_split_names_each_nodes_host_through_its_rpc_worker() -> None:
    nodes = [node("a", ram=20 * GIB, model=True), node("b", ram=20 * GIB)]
    result = plan_placement(request(32 * GIB), nodes)
    plan = result.plan
    assert plan is not None and plan.tier == TIER_CPU_OVER_RPC
    assert devices_of(result) == [("a", HOST_DEVICE, True), ("b", HOST_DEVICE, True)]
    assert plan.n_gpu_layers is None


def test_a_cpu_only_node_has_no_device_list_and_all_layers() -> None:
    result = plan_placement(request(2 * GIB), [node("a", ram=8 * GIB, model=True)])
    plan = result.plan
    assert plan is not None and plan.tier == TIER_CPU
    assert plan.devices == () and plan.n_gpu_layers is None


def test_nodes_of_another_rpc_protocol_are_never_mixed_in() -> None:
    nodes = [
        node("a", 24 * GIB, ram=16 * GIB, model=True),
        node("b", 80 * GIB, protocol="6.0.0"),
        node("c", 24 * GIB),
    ]
    plan = plan_placement(request(40 * GIB), nodes).plan
    assert plan is not None and plan.node_ids == ("a", "c")


def test_a_split_that_only_mixed_protocols_could_hold_is_refused_by_name() -> None:
    nodes = [
        node("a", 24 * GIB, ram=8 * GIB, model=True),
        node("b", 24 * GIB, ram=8 * GIB, protocol="6.0.0"),
    ]
    result = plan_placement(request(40 * GIB), nodes)
    assert result.plan is None and result.no_capacity is not None
    assert result.no_capacity.code == RPC_VERSION_MISMATCH
    assert "6.0.0 on host-b" in result.no_capacity.reason
    assert "7.0.0 on host-a" in result.no_capacity.reason


def test_more_slots_only_as_far_as_the_chosen_devices_hold_them() -> None:
    needs = ModelNeeds("m", SHA, "m.gguf", 4 * GIB, 32, 128 * 1024, 8192)
    req = PlacementRequest(
        needs, 4096, DEFAULT_ALLOWED_PEER_CIDRS, headroom_fraction=0.0, overhead_bytes=0
    )
    plan = plan_placement(req, [node("a", 8 * GIB, model=True, slots=8)]).plan
    assert plan is not None and plan.tier == TIER_ONE_DEVICE
    # 4 GiB of weights plus 0.5 GiB of KV cache per slot in 7.5 GiB of room: 7 slots.
    assert plan.parallel == 7
    assert plan.required_bytes == required_bytes(needs, 4096 * 7, 0.0, 0)
    assert plan.devices[0].assigned_bytes <= 8 * GIB


def test_a_device_plan_survives_its_dict() -> None:
    nodes = [node("a", 24 * GIB, 12 * GIB, model=True), node("b", 80 * GIB)]
    plan = plan_placement(request(100 * GIB), nodes).plan
    assert plan is not None
    assert ExecutionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


# ---------------------------------------------------------------------------------------------
# properties

GPU_SIZES = [0, 300 * MIB, 1 * GIB, 4 * GIB, 8 * GIB, 24 * GIB, 80 * GIB]


#: What the property tests draw: a placement request and the candidate nodes.
Scenario = tuple[PlacementRequest, list[Candidate]]


@st.composite
def inventories(draw: st.DrawFn) -> Scenario:
    count = draw(st.integers(min_value=1, max_value=5))
    candidates = []
    for i in range(count):
        gpus = draw(st.lists(st.sampled_from(GPU_SIZES), max_size=3))
        jitter = draw(st.integers(min_value=0, max_value=3)) * 7 * MIB
        candidates.append(
            node(
                f"n{i}",
                *(g + jitter for g in gpus if g),
                ram=draw(st.sampled_from([1, 4, 16, 64])) * GIB + jitter,
                model=i == 0 or draw(st.booleans()),
                protocol=draw(st.sampled_from(["7.0.0"] * 5 + ["6.0.0"])),
                state=draw(st.sampled_from(["READY"] * 4 + ["DEGRADED"])),
                slots=draw(st.sampled_from([1, 1, 2, 4])),
            )
        )
    weights = (
        draw(st.sampled_from([1, 3, 7, 20, 30, 60, 100, 150])) * GIB
        + draw(st.integers(min_value=0, max_value=5)) * 101 * MIB
    )
    req = request(
        weights,
        layers=draw(st.sampled_from([32, 8, 3])),
        max_nodes=draw(st.sampled_from([8, 3, 2])),
        reserve=draw(st.sampled_from([RESERVE, 0, 64 * MIB])),
    )
    return req, candidates


def _units(room: int, required: int) -> int:
    return min(RES, room * RES // required) if room > 0 else 0


def _rooms(c: Candidate, reserve: int) -> list[int]:
    return [d.usable_bytes - reserve for d in c.devices if d.usable_bytes > reserve]


def _tier_fits(tier: str, nodes: tuple[Candidate, ...], req: PlacementRequest) -> bool:
    """Independent restatement of what each tier can hold (``nodes[0]`` is the primary)."""
    p = nodes[0]
    required, reserve, layers = req.required_bytes, req.device_reserve_bytes, req.needs.layers
    if not p.has_model or len({c.rpc_protocol for c in nodes}) > 1:
        return False
    if tier == TIER_ONE_DEVICE:
        return len(nodes) == 1 and any(r >= required for r in _rooms(p, reserve))
    if tier == TIER_ONE_NODE_GPUS:
        return len(nodes) == 1 and sum(_units(r, required) for r in _rooms(p, reserve)) >= RES
    if tier == TIER_GPUS_OVER_RPC:
        rooms = [r for c in nodes for r in _rooms(c, reserve)]
        return len(nodes) > 1 and sum(_units(r, required) for r in rooms) >= RES
    if tier == TIER_GPUS_AND_HOST:
        if len(nodes) > 1:
            return False
        for g in range(1, layers + 1):
            on_gpus = -(-required * g // layers)
            if (
                sum(_units(r, on_gpus) for r in _rooms(p, reserve)) >= RES
                and p.usable_memory_bytes >= required - on_gpus
            ):
                return True
        return False
    if (tier == TIER_CPU) != (len(nodes) == 1):
        return False  # cpu: one node; cpu_over_rpc: several
    return sum(_units(c.usable_memory_bytes, required) for c in nodes) >= RES


def _brute(req: PlacementRequest, pool: list[Candidate]) -> tuple[str, int] | None:
    """(first tier with a plan, fewest nodes in it) by exhaustive search, or None."""
    limit = min(req.max_nodes, req.needs.layers)
    for tier in TIERS:
        for k in range(1, min(limit, len(pool)) + 1):
            for subset in itertools.combinations(pool, k):
                for primary in subset:
                    rest = tuple(c for c in subset if c is not primary)
                    if _tier_fits(tier, (primary, *rest), req):
                        return tier, k
    return None


PROPERTIES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def over_inventories(test: Callable[[Scenario], None]) -> Callable[..., None]:
    """``test`` as a property of every inventory :func:`inventories` draws (PROPERTIES)."""
    return PROPERTIES(given(inventories())(test))


@over_inventories
def test_property_no_device_is_given_more_than_it_has(scenario: Scenario) -> None:
    req, candidates = scenario
    plan = plan_placement(req, candidates).plan
    if plan is None:
        return
    by_id = {c.node_id: c for c in candidates}
    assert sum(round(d.share * RES) for d in plan.devices) in (0, RES)
    for d in plan.devices:
        c = by_id[d.node_id]
        if d.device == HOST_DEVICE:
            assert d.assigned_bytes <= c.usable_memory_bytes
        else:
            [device] = [x for x in c.devices if x.name == d.device]
            assert d.assigned_bytes <= device.usable_bytes
            assert d.assigned_bytes >= req.device_reserve_bytes
    for n in plan.nodes:
        c = by_id[n.node_id]
        on_gpus = sum(
            d.assigned_bytes
            for d in plan.devices
            if d.node_id == n.node_id and d.device != HOST_DEVICE
        )
        # what is left of the node's share is in its host memory (gpus_and_host, cpu)
        assert n.assigned_bytes - on_gpus <= c.usable_memory_bytes
    if plan.tier == TIER_GPUS_AND_HOST:
        assert plan.n_gpu_layers is not None and 1 <= plan.n_gpu_layers <= req.needs.layers


@over_inventories
def test_property_the_first_tier_that_holds_it_with_the_fewest_nodes(scenario: Scenario) -> None:
    req, candidates = scenario
    result = plan_placement(req, candidates)
    ready = _brute(req, [c for c in candidates if c.state == "READY"])
    anyone = _brute(req, candidates)
    if ready is not None:
        assert result.plan is not None and not result.fallback_used
        assert (result.plan.tier, len(result.plan.nodes)) == ready
    elif anyone is not None:
        assert result.plan is not None and result.fallback_used
        assert (result.plan.tier, len(result.plan.nodes)) == anyone
    else:
        assert result.plan is None


@over_inventories
def test_property_a_split_never_mixes_rpc_protocols(scenario: Scenario) -> None:
    req, candidates = scenario
    result = plan_placement(req, candidates)
    by_id = {c.node_id: c for c in candidates}
    if result.plan is not None:
        assert len({by_id[n].rpc_protocol for n in result.plan.node_ids}) == 1
        return
    unified = [dataclasses.replace(c, rpc_protocol="7.0.0") for c in candidates]
    if plan_placement(req, unified).plan is not None:
        assert result.no_capacity is not None
        assert result.no_capacity.code == RPC_VERSION_MISMATCH


@PROPERTIES
@given(inventories(), st.randoms(use_true_random=False))
def test_property_the_plan_does_not_depend_on_the_order_of_the_nodes(
    scenario: Scenario, rnd: object
) -> None:
    req, candidates = scenario
    shuffled = list(candidates)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert plan_placement(req, shuffled) == plan_placement(req, candidates)
