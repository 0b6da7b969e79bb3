"""The split planner and the links nodes measured (domain/split_planner.py, NODE_LINKS_MEASURED):
split partners over the fastest links, and no split over a link slower than
MIN_SPLIT_LINK_MBPS, with the link named."""

from __future__ import annotations

import dataclasses

from domain.placement import GIB, SLOW_LINK, Candidate, Link, PlacementResult, link_between
from domain.split_planner import plan_placement
from tests.unit.placement_builders import candidate, exact_request, weights_only

SHA = "cd" * 32
NEEDS = weights_only("m", SHA, "m.gguf", 10 * GIB, 30)

FAST = Link(mbps=940.0, rtt_ms=0.2)  # 1 GbE
SLOW = Link(mbps=95.0, rtt_ms=5.1)  # 100 Mbit/s, a few hops away


def node(
    node_id: str, memory: int, links: dict[str, Link] | None = None, *, has_model: bool = False
) -> Candidate:
    return dataclasses.replace(candidate(node_id, memory, has_model=has_model), links=links or {})


def workers(result: PlacementResult) -> tuple[str, ...]:
    assert result.plan is not None, result.no_capacity
    return tuple(w.node_id for w in result.plan.workers)


def test_the_split_partner_is_the_one_behind_the_fastest_link() -> None:
    """The primary holds 6 of 10 GiB; either worker holds the rest. The slow one is roomier,
    which alone would have made it the partner."""
    primary = node("p", 6 * GIB, {"fast": FAST, "slow": SLOW}, has_model=True)
    fast, slow = node("fast", 5 * GIB), node("slow", 8 * GIB)
    request = exact_request(NEEDS, context_size=2048)
    assert workers(plan_placement(request, [primary, fast, slow])) == ("fast",)
    # unmeasured, the roomiest is taken, as before links were known
    blind = node("p", 6 * GIB, has_model=True)
    assert workers(plan_placement(request, [blind, fast, slow])) == ("slow",)


def test_a_link_measured_from_the_worker_side_counts_and_the_slower_direction_wins() -> None:
    primary = node("p", 6 * GIB, {"fast": FAST}, has_model=True)
    fast = node("fast", 5 * GIB, {"p": Link(mbps=300.0, rtt_ms=0.4)})
    slow = node("slow", 8 * GIB, {"p": SLOW})
    assert link_between(primary, fast) == Link(300.0, 0.4)
    assert link_between(slow, primary) == SLOW
    assert link_between(fast, slow) is None
    request = exact_request(NEEDS, context_size=2048)
    assert workers(plan_placement(request, [primary, fast, slow])) == ("fast",)


def test_the_fewest_nodes_come_before_the_fastest_links() -> None:
    """The fast worker cannot complete the model alone: one slow partner beats two nodes."""
    primary = node("p", 6 * GIB, {"fast": FAST, "slow": SLOW, "other": FAST}, has_model=True)
    nodes = [primary, node("fast", 2 * GIB), node("other", 2 * GIB), node("slow", 5 * GIB)]
    assert workers(plan_placement(exact_request(NEEDS, context_size=2048), nodes)) == ("slow",)


def test_no_split_over_a_link_slower_than_the_floor_and_the_refusal_names_it() -> None:
    primary = node("p", 6 * GIB, {"slow": SLOW}, has_model=True)
    slow = node("slow", 8 * GIB)
    request = dataclasses.replace(exact_request(NEEDS, context_size=2048), min_link_mbps=200.0)
    result = plan_placement(request, [primary, slow])
    assert result.plan is None and result.no_capacity is not None
    assert result.no_capacity.code == SLOW_LINK
    assert "MIN_SPLIT_LINK_MBPS=200" in result.no_capacity.reason
    assert "host-p to host-slow (95 Mbit/s, 5.1 ms)" in result.no_capacity.reason
    # a fast partner is still taken, and an unmeasured link is not refused
    fast = node("fast", 5 * GIB)
    assert workers(plan_placement(request, [primary, slow, fast])) == ("fast",)
    # no floor: the slow link is used when it is the only way
    floorless = dataclasses.replace(request, min_link_mbps=0.0)
    assert workers(plan_placement(floorless, [primary, slow])) == ("slow",)


def test_a_model_one_node_holds_is_not_split_whatever_the_links() -> None:
    primary = node("p", 12 * GIB, {"fast": FAST}, has_model=True)
    result = plan_placement(
        exact_request(NEEDS, context_size=2048), [primary, node("fast", 8 * GIB)]
    )
    assert workers(result) == ()
