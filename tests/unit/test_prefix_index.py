"""domain/prefix_index.py: prefix chains, the index of what each server's cache holds, and
routing by the longest prefix under bounded loads."""

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
    server_cache_blocks,
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


def blocks_of(found: dict[str, PrefixMatch]) -> dict[str, int]:
    return {server: match.blocks for server, match in found.items()}


def test_an_earlier_turn_is_told_from_a_shared_beginning() -> None:
    """``extends``: the longest prompt a server holds that the new one wholly extends (its
    conversation's earlier turn), not a beginning it shares with another prompt."""
    index = PrefixIndex()
    index.record("a", chain("s", "s", "x", "y"), server_blocks=100)  # another conversation
    index.record("b", chain("s", "s", "t"), server_blocks=100)  # this one's first turn
    found = index.match(chain("s", "s", "t", "u", "v"))
    assert found == {"a": PrefixMatch(2, extends=0), "b": PrefixMatch(3, extends=3)}
    index.record("a", chain("s", "s"), server_blocks=100)  # the system prompt alone
    assert index.match(chain("s", "s", "t", "u"))["a"] == PrefixMatch(2, extends=2)


def test_the_longest_prefix_per_server() -> None:
    index = PrefixIndex()
    index.record("a", chain("s", "t", "u"), server_blocks=100)
    index.record("a", chain("s", "x"), server_blocks=100)
    index.record("b", chain("s"), server_blocks=100)
    found = index.match(chain("s", "t", "u", "v"))
    assert found == {"a": PrefixMatch(3, extends=3), "b": PrefixMatch(1, extends=1)}
    assert blocks_of(index.match(chain("q", "t"))) == {}
    assert len(index) == 6 and index.prompts("a") == 2


def test_a_server_keeps_many_conversations_and_a_lost_server_none() -> None:
    """llama-server saves a slot's prompt in its prompt cache before the slot takes another:
    a server holds every conversation sent there, not one per slot."""
    index = PrefixIndex()
    for conversation in ("p", "q", "r", "s"):  # more conversations than any slot count
        index.record("a", chain(conversation, "t"), server_blocks=100)
    assert blocks_of(index.match(chain("p", "t", "u"))) == {"a": 2}
    index.record("b", chain("z", "y"), server_blocks=100)
    index.forget("a")
    assert blocks_of(index.match(chain("p", "t"))) == {}
    assert blocks_of(index.match(chain("z", "y"))) == {"b": 2}
    assert index.prompts("a") == 0 and index.prompts("b") == 1
    assert len(index) == 2


def test_a_longer_turn_replaces_the_prompt_it_extends() -> None:
    """The next turn of a conversation contains the last one: llama-server keeps the longer."""
    index = PrefixIndex()
    index.record("a", chain("s", "t"), server_blocks=100)
    index.record("a", chain("s", "t", "u"), server_blocks=100)
    index.record("a", chain("s", "t", "u"), server_blocks=100)  # the same prompt again
    assert index.prompts("a") == 1 and len(index) == 3
    # a branch (another last turn) does not contain it: both are kept
    index.record("a", chain("s", "t", "w"), server_blocks=100)
    assert index.prompts("a") == 2
    assert blocks_of(index.match(chain("s", "t", "u"))) == {"a": 3}


def test_a_full_server_forgets_the_prompts_sent_longest_ago() -> None:
    index = PrefixIndex()
    index.record("a", chain("p", "q"), server_blocks=4)
    index.record("a", chain("r", "s"), server_blocks=4)
    index.record("b", chain("p", "q"), server_blocks=4)  # another server's room is its own
    index.record("a", chain("t"), server_blocks=4)  # 5 blocks on a: p q goes
    assert blocks_of(index.match(chain("p", "q"))) == {"b": 2}
    assert blocks_of(index.match(chain("r", "s"))) == {"a": 2}
    # one prompt longer than the room is still held: the server's slot has it
    index.record("c", chain("p", "q", "r"), server_blocks=2)
    assert blocks_of(index.match(chain("p", "q", "r"))) == {"b": 2, "c": 3}


def test_capacity_forgets_the_prompts_sent_longest_ago_over_every_server() -> None:
    index = PrefixIndex(capacity=4)
    index.record("a", chain("p", "q"), server_blocks=100)
    index.record("b", chain("r", "s"), server_blocks=100)
    index.record("c", chain("t"), server_blocks=100)
    assert len(index) == 3
    assert set(index.match(chain("p", "q"))) == set()  # a's prompt was the oldest
    assert blocks_of(index.match(chain("r", "s"))) == {"b": 2}


def test_a_server_holds_its_slots_and_its_prompt_cache() -> None:
    """8 GiB of prompt cache at 128 KiB a token is 65,536 tokens, 4 characters each; plus
    4 slots of 2,048 tokens: 73,728 tokens, 294,912 characters, 1,152 blocks of 256."""
    assert server_cache_blocks(128 << 10, 2048, 4) == 1152
    assert server_cache_blocks(0, 2048, 4) == 1152  # a model that does not say: 128 KiB
    assert server_cache_blocks(32 << 10, 0, 1) == (8192 << 20) // (32 << 10) * 4 // 256


def test_route_takes_the_longest_prefix_within_the_bound() -> None:
    matches = {"a": PrefixMatch(5), "b": PrefixMatch(2)}
    assert prefix_route(matches, {"a": 1, "b": 1, "c": 1}) == PrefixRoute("a", 5)
    # one job of slack: a may run 2 while the others run none
    assert prefix_route(matches, {"a": 1, "b": 0, "c": 0}) == PrefixRoute("a", 5)
    # a is loaded beyond the bound (ceil(1.25 * 7 / 3) + 1 = 4): the next longest, b, takes it
    assert prefix_route(matches, {"a": 4, "b": 1, "c": 1}) == PrefixRoute("b", 2)
    # nobody within the bound (ceil(1.25 * 17 / 4) + 1 = 7) holds anything: a miss
    assert prefix_route(matches, {"a": 8, "b": 8, "c": 0, "d": 0}) is None
    # a server that is not a candidate (busy, excluded) is never chosen
    assert prefix_route(matches, {"b": 0, "c": 0}) == PrefixRoute("b", 2)
    assert prefix_route(matches, {}) is None
    assert prefix_route({"a": PrefixMatch(1)}, {"a": 0}, min_blocks=2) is None


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
        route = prefix_route({holder: PrefixMatch(3)}, running, epsilon=epsilon)
        # a miss goes to the least loaded server, as the fallback placement would
        chosen = route.server if route else min(names, key=lambda n: (running[n], n))
        running[chosen] += 1
        if route:
            assert running[chosen] <= math.ceil((1 + epsilon) * (total + 1) / servers) + 1
    assert max(running.values()) <= load_bound(sum(running.values()) - 1, servers, epsilon)
