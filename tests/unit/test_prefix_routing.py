"""application/prefix_routing.py: a prompt's canonical text, and conversations routed back to
the server that holds their prefix, on the job manager's fake cluster (no sleeps)."""

from __future__ import annotations

import asyncio
import random
from typing import Any
from uuid import UUID, uuid4

from application.commands import ChatPrompt, EmbeddingInputs, JobParams, Submission, TextPrompt
from application.prefix_routing import PrefixRouter, prefix_text
from domain.job import Job
from domain.prefix_index import BLOCK_CHARS
from domain.runtimes import WarmChoice, server_of
from tests.unit.job_cluster import GUARD, Cluster, queued_count_is
from tests.unit.test_runtimes import plan

SYSTEM = "You are a careful assistant for the operators of a LAN cluster. " * 96  # ~6 KB


def test_a_later_turn_extends_the_text_of_the_turn_before() -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    first, second = prefix_text(ChatPrompt(turn1, tools)), prefix_text(ChatPrompt(turn2, tools))
    assert first is not None and second is not None and second.startswith(first)
    # a role is part of the text: the same words said by another role are another prompt
    assert prefix_text(ChatPrompt([{"role": "user", "content": "x"}])) != prefix_text(
        ChatPrompt([{"role": "system", "content": "x"}])
    )
    # multimodal content parts and tool calls count too
    parts = ChatPrompt([{"role": "user", "content": [{"type": "text", "text": "p"}]}])
    assert '"text":"p"' in (prefix_text(parts) or "")
    assert prefix_text(TextPrompt("abc")) == "abc"
    assert prefix_text(TextPrompt([1, 2])) == "1 2"
    assert prefix_text(EmbeddingInputs(["x"])) is None


def test_routes_are_recorded_as_hit_miss_or_not_routed() -> None:
    router = PrefixRouter()
    chat = ChatPrompt([{"role": "user", "content": "y" * (3 * BLOCK_CHARS)}])
    assert router.route_of(chat, None) == {"prefix": "miss", "matched_chars": 0}
    assert router.route_of(EmbeddingInputs(["x"]), None) is None
    assert len(router.chain(chat)) == 3
    assert router.chain(EmbeddingInputs(["x"])) == ()


def test_a_router_turned_off_routes_nothing_and_records_no_route() -> None:
    """PREFIX_ROUTING=off: no chain, so no server is chosen by prefix and nothing is kept."""
    router = PrefixRouter(enabled=False)
    chat = ChatPrompt([{"role": "user", "content": "y" * (3 * BLOCK_CHARS)}])
    assert router.chain(chat) == ()
    assert router.route_of(chat, None) is None
    router.sent("server", router.chain(chat), cache_blocks=100)
    assert len(router.index) == 0
    on = PrefixRouter()
    on.sent("server", on.chain(chat), cache_blocks=100)
    assert len(on.index) > 0 and on.route_of(chat, None) == {"prefix": "miss", "matched_chars": 0}


def ask(who: int, turn: int) -> str:
    """A user's turn: a few sentences (longer than a prefix block, as real turns are)."""
    return f"Question {turn} from conversation {who}: " + "what does the log say? " * 16


def conversation_turn(history: list[dict[str, Any]]) -> Submission:
    return Submission("m", ChatPrompt(list(history)), JobParams(max_tokens=4), True)


async def run_turns(cluster: Cluster, turns: dict[UUID, Submission]) -> dict[UUID, str]:
    """Starts every turn at once (in a random order), validates and finishes them all; returns
    the node each job ran on."""
    order = list(turns)
    random.Random(len(order)).shuffle(order)
    before = len(cluster.gateway.primaries)
    tasks = [
        asyncio.create_task(cluster.jobs.start(turns[job], cluster.model, job)) for job in order
    ]
    placed = await cluster.primary_assigned(before + len(order))
    ran = {UUID(job): node for node, job in placed[before:]}
    for node, job in placed[before:]:
        await cluster.validate(node, job)
    await asyncio.wait_for(asyncio.gather(*tasks), GUARD)
    for node, job in placed[before:]:
        await cluster.finish(node, job)
    return ran


async def test_each_conversation_goes_back_to_the_server_of_its_first_turn() -> None:
    """4 nodes with 2 slots, 8 conversations resending a shared 6 KB system prompt and their
    history, every turn of all of them at once: each later turn lands where its first did.
    (Without routing by prefix, a turn goes to the server with the most free slots.)"""
    cluster = Cluster(4, slots=2)
    talks = {
        uuid4(): [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask(i, 1)}]
        for i in range(8)
    }
    opening = {uuid4(): talk for talk in talks}
    first = await run_turns(
        cluster, {job: conversation_turn(talks[talk]) for job, talk in opening.items()}
    )
    home = {talk: first[job] for job, talk in opening.items()}
    assert sorted(first.values()) == sorted(cluster.node_ids * 2)  # two per node
    for turn in range(2, 5):
        jobs = {}
        for talk, history in talks.items():
            history += [
                {"role": "assistant", "content": f"answer {turn}: " + "words " * 60},
                {"role": "user", "content": ask(talk.int, turn)},
            ]
            jobs[uuid4()] = (talk, conversation_turn(history))
        ran = await run_turns(cluster, {job: sub for job, (_, sub) in jobs.items()})
        for job, (talk, _) in jobs.items():
            assert ran[job] == home[talk], f"turn {turn} of a conversation moved"
            row = cluster.read.get_job(str(job))
            assert row is not None
            route = row["route"]
            assert route["prefix"] == "hit"
            assert route["matched_chars"] >= len(SYSTEM) // BLOCK_CHARS * BLOCK_CHARS


def talk(seed: str) -> list[dict[str, Any]]:
    """A conversation's opening: a system prompt of its own (nothing shared with another)."""
    return [
        {"role": "system", "content": f"{seed}: " + "keep the answers short. " * 40},
        {"role": "user", "content": ask(0, 1)},
    ]


def next_turn(history: list[dict[str, Any]], last: str) -> list[dict[str, Any]]:
    answer = {"role": "assistant", "content": "an answer " * 30}
    return [*history, answer, {"role": "user", "content": last}]


async def test_a_turn_waits_for_its_busy_server_and_then_goes_back_to_it() -> None:
    """2 nodes with 1 slot. Conversation A's server is busy with A's other branch while the
    other node is free: A's next turn waits (JOB_QUEUED, WAITS_FOR_CACHE) instead of starting
    over on the free node, and goes back home when the branch ends. A new conversation that
    comes meanwhile takes the free node before A (it holds nobody's prefix)."""
    cluster = Cluster(2, slots=1)
    a, b, opening_a = talk("a"), talk("b"), uuid4()
    first = await run_turns(
        cluster, {opening_a: conversation_turn(a), uuid4(): conversation_turn(b)}
    )
    home_a = first[opening_a]
    other = next(n for n in cluster.node_ids if n != home_a)

    branch = asyncio.create_task(
        cluster.jobs.start(conversation_turn(next_turn(a, "branch")), cluster.model, uuid4())
    )
    [(node, branch_job)] = (await cluster.primary_assigned(3))[2:]
    assert node == home_a
    await cluster.validate(node, branch_job)
    await asyncio.wait_for(branch, GUARD)

    turn2 = uuid4()
    waiting = asyncio.create_task(
        cluster.jobs.start(conversation_turn(next_turn(a, "turn 2")), cluster.model, turn2)
    )
    await cluster.until(lambda: queued_count_is(cluster, 1))
    [queued] = [e for e in cluster._events(str(turn2)) if isinstance(e, Job.Queued)]
    assert "holding this conversation's prompt prefix is busy" in queued.reason
    assert len(cluster.gateway.primaries) == 3  # not started over on the free node

    newcomer = uuid4()
    stranger = asyncio.create_task(
        cluster.jobs.start(conversation_turn(talk("c")), cluster.model, newcomer)
    )
    [(node, job)] = (await cluster.primary_assigned(4))[3:]
    assert (node, job) == (other, str(newcomer))  # it went before A, to the node A let go by
    await cluster.validate(node, job)
    await asyncio.wait_for(stranger, GUARD)

    await cluster.finish(home_a, branch_job)
    [(node, job)] = (await cluster.primary_assigned(5))[4:]
    assert (node, job) == (home_a, str(turn2))
    await cluster.validate(node, job)
    await asyncio.wait_for(waiting, GUARD)
    row = cluster.read.get_job(str(turn2))
    assert row is not None and row["route"]["prefix"] == "hit"


def test_next_to_go_waits_for_a_busy_home_within_its_slots_and_passes() -> None:
    """Server a (2 slots, both busy) holds conversations x and y; b has a free slot. The
    first two waiting for a take turns waiting (they pass); a third waiting for a would wait
    beyond a's slots, so it takes b's slot. A request that may pass no more takes it too, and
    one whose prefix nobody holds takes it at once."""
    router = PrefixRouter()
    x, y, z = (router.chain(ChatPrompt(talk(seed))) for seed in "xyz")
    for chain in (x, y, z):
        router.sent(server_of(plan("a", parallel=2)), chain, cache_blocks=1000)
    servers = [
        WarmChoice(plan("a", parallel=2), free_slots=0, degraded=False),
        WarmChoice(plan("b", parallel=2), free_slots=1, degraded=False),
    ]
    assert router.next_to_go([(x, True), (y, True), (z, True)], servers) == (2, [0, 1])
    assert router.next_to_go([(x, False), (y, True)], servers) == (0, [])
    assert router.next_to_go([(x, True), (y, True)], servers) == (None, [0, 1])
    stranger = router.chain(ChatPrompt(talk("w")))
    assert router.next_to_go([(x, True), (stranger, True)], servers) == (1, [0])
    # a free slot on a itself: x is home, at once
    servers[0] = WarmChoice(plan("a", parallel=2), free_slots=1, degraded=False)
    assert router.next_to_go([(x, True)], servers) == (0, [])
    # nothing free anywhere: the head tries (a cold plan may start a server for it)
    full = [WarmChoice(plan("b", parallel=2), free_slots=0, degraded=False)]
    assert router.next_to_go([(x, True)], full) == (0, [])


def shared(seed: str) -> list[dict[str, Any]]:
    """A conversation's opening with the system prompt every conversation shares."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{seed}? " * 90}]


def test_next_to_go_waits_for_a_conversation_not_for_a_shared_system_prompt() -> None:
    """Busy server a holds another conversation that begins with the same system prompt, and
    b's slot is free: a new conversation does not wait for a (the system prompt is worth one
    prefill on b, not a whole job's wait), but the next turn of a conversation a holds does."""
    router = PrefixRouter()
    x = router.chain(ChatPrompt(shared("x")))
    router.sent(server_of(plan("a", parallel=1)), x, cache_blocks=1000)
    servers = [
        WarmChoice(plan("a", parallel=1), free_slots=0, degraded=False),
        WarmChoice(plan("b", parallel=1), free_slots=1, degraded=False),
    ]
    sibling = router.chain(ChatPrompt(shared("y")))
    [home] = router.index.match(sibling).values()
    assert home.blocks >= len(SYSTEM) // BLOCK_CHARS
    assert router.next_to_go([(sibling, True)], servers) == (0, [])
    later = router.chain(ChatPrompt(next_turn(shared("x"), "and then?")))
    assert router.next_to_go([(later, True)], servers) == (None, [0])
    # once b holds the system prompt as well, a's conversation is still worth the wait
    router.sent(server_of(plan("b", parallel=1)), sibling, cache_blocks=1000)
    assert router.next_to_go([(later, True)], servers) == (None, [0])


async def test_a_node_gone_takes_its_servers_caches_with_it() -> None:
    """The job manager's node_gone (its agent stopped, or it stayed away) makes the router
    forget the node's servers: a later turn is not sent back to a cache that is gone."""
    cluster = Cluster(2, slots=1)
    opening = uuid4()
    home = (await run_turns(cluster, {opening: conversation_turn(talk("a"))}))[opening]
    router = cluster.jobs.scheduler.router
    assert any(server.startswith(f"{home}/") for server in router.index.servers())
    await cluster.jobs.node_gone(home)
    assert not any(server.startswith(f"{home}/") for server in router.index.servers())


def test_forgetting_a_node_forgets_only_its_servers() -> None:
    router = PrefixRouter()
    x, y = (router.chain(ChatPrompt(talk(seed))) for seed in "xy")
    router.sent(server_of(plan("a", parallel=1)), x, cache_blocks=1000)
    router.sent(server_of(plan("ab", parallel=1)), y, cache_blocks=1000)
    router.forget_node("a")
    assert router.index.match(x) == {}  # node a's server: forgotten
    assert list(router.index.match(y)) == [server_of(plan("ab", parallel=1))]  # not "a"-prefixed
