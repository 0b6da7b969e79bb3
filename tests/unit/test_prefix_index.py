"""domain/prefix_index.py: prefix chains, the index of what each slot holds, and routing by
the longest prefix under bounded loads."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.prefix_index import (
    BLOCK_CHARS,
    PrefixIndex,
    PrefixMatch,
    PrefixRoute,
    load_bound,
    prefix_chain,
    prefix_route,
)

texts = st.text(min_size=0, max_size=40)


@given(common=texts, a=texts, b=texts)
def test_two_prompts_share_exactly_the_blocks_of_their_common_prefix(
    common: str, a: str, b: str
) -> None:
    block = 4
    first, second = prefix_chain(common + a, block), prefix_chain(common + b, block)
    shared = 0
    left, right = common + a, common + b
    while (shared + 1) * block <= min(len(left), len(right)) and (
        left[: (shared + 1) * block] == right[: (shared + 1) * block]
    ):
        shared += 1
    assert first[:shared] == second[:shared]
    if shared < min(len(first), len(second)):
        # the first differing block differs, and so does every hash after it (chained)
        assert all(x != y for x, y in zip(first[shared:], second[shared:], strict=False))


def test_only_whole_blocks_are_hashed() -> None:
    assert prefix_chain("x" * (BLOCK_CHARS - 1)) == ()
    assert len(prefix_chain("x" * (3 * BLOCK_CHARS + 10))) == 3
    with pytest.raises(ValueError, match="positive"):
        prefix_chain("abc", 0)


def chain(*blocks: str) -> tuple[int, ...]:
    return prefix_chain("".join(b * 4 for b in blocks), 4)


def test_the_longest_prefix_per_server_and_its_slot() -> None:
    index = PrefixIndex()
    index.put("a", 0, chain("s", "t", "u"))
    index.put("a", 1, chain("s", "x"))
    index.put("b", 0, chain("s"))
    found = index.match(chain("s", "t", "u", "v"))
    assert found == {"a": PrefixMatch(3, 0), "b": PrefixMatch(1, 0)}
    assert index.match(chain("q", "t")) == {}
    assert len(index) == 6


def test_a_slot_holds_one_prompt_and_a_lost_server_holds_none() -> None:
    index = PrefixIndex()
    index.put("a", 0, chain("s", "t"))
    index.put("a", 0, chain("z"))  # the slot was reused: the old conversation ages out
    assert index.match(chain("s", "t")) == {}
    assert index.match(chain("z")) == {"a": PrefixMatch(1, 0)}
    index.put("b", 1, chain("z", "y"))
    index.forget("a")
    assert index.match(chain("z", "y")) == {"b": PrefixMatch(2, 1)}
    assert list(index.held("a")) == [] and list(index.held("b")) == [1]
    assert len(index) == 2


def test_capacity_forgets_the_slots_recorded_longest_ago() -> None:
    index = PrefixIndex(capacity=4)
    index.put("a", 0, chain("p", "q"))
    index.put("b", 0, chain("r", "s"))
    index.put("c", 0, chain("t"))
    assert len(index) == 3
    assert set(index.match(chain("p", "q"))) == set()  # a's slot was the oldest
    assert index.match(chain("r", "s")) == {"b": PrefixMatch(2, 0)}


def test_a_prompt_goes_to_the_slot_llama_server_would_pick() -> None:
    index = PrefixIndex()
    assert index.record("a", chain("s", "t"), slots=2) == 0  # empty slots first
    assert index.record("a", chain("q"), slots=2) == 1
    # the next turn of the first conversation extends slot 0's prompt: slot 0 takes it
    assert index.record("a", chain("s", "t", "u"), slots=2) == 0
    assert index.match(chain("s", "t", "u")) == {"a": PrefixMatch(3, 0)}
    # a new conversation shares nothing: the slot used longest ago (1) gives way
    assert index.record("a", chain("w"), slots=2) == 1
    assert index.match(chain("q")) == {}
    assert index.match(chain("s", "t", "u")) == {"a": PrefixMatch(3, 0)}


def test_route_takes_the_longest_prefix_within_the_bound() -> None:
    matches = {"a": PrefixMatch(5, 1), "b": PrefixMatch(2, 0)}
    assert prefix_route(matches, {"a": 1, "b": 1, "c": 1}) == PrefixRoute("a", 5, 1)
    # one job of slack: a may run 2 while the others run none
    assert prefix_route(matches, {"a": 1, "b": 0, "c": 0}) == PrefixRoute("a", 5, 1)
    # a is loaded beyond the bound (ceil(1.25 * 7 / 3) + 1 = 4): the next longest, b, takes it
    assert prefix_route(matches, {"a": 4, "b": 1, "c": 1}) == PrefixRoute("b", 2, 0)
    # nobody within the bound (ceil(1.25 * 17 / 4) + 1 = 7) holds anything: a miss
    assert prefix_route(matches, {"a": 8, "b": 8, "c": 0, "d": 0}) is None
    # a server that is not a candidate (busy, excluded) is never chosen
    assert prefix_route(matches, {"b": 0, "c": 0}) == PrefixRoute("b", 2, 0)
    assert prefix_route(matches, {}) is None
    assert prefix_route({"a": PrefixMatch(1, 0)}, {"a": 0}, min_blocks=2) is None


@given(
    servers=st.integers(min_value=1, max_value=8),
    picks=st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=200),
    epsilon=st.sampled_from([0.1, 0.25, 1.0]),
)
def test_no_server_runs_more_than_the_bound_however_the_prefixes_fall(
    servers: int, picks: list[int], epsilon: float
) -> None:
    """Every request's prefix is on one server (``picks``); jobs never end. Whatever the
    prefixes, a server only takes a job that keeps it within ceil((1 + eps) * (n + 1) / N) + 1."""
    names = [f"s{i}" for i in range(servers)]
    running = dict.fromkeys(names, 0)
    for pick in picks:
        holder = names[pick % servers]
        total = sum(running.values())
        route = prefix_route({holder: PrefixMatch(3, 0)}, running, epsilon=epsilon)
        # a miss goes to the least loaded server, as the fallback placement would
        chosen = route.server if route else min(names, key=lambda n: (running[n], n))
        running[chosen] += 1
        if route:
            assert running[chosen] <= math.ceil((1 + epsilon) * (total + 1) / servers) + 1
    assert max(running.values()) <= load_bound(sum(running.values()) - 1, servers, epsilon)
